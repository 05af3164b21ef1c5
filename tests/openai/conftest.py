"""Fixtures for the OpenAI front's tests: served stacks (in-process, loopback) and clients.

- `sim`: the torch-free ScriptedWorker (tests/grpc/conftest.py) with a tiny Hugging Face
  tokenizer that has special tokens, and the front with its ChatML template. Its tokens are a
  hash of the context read back through the paged KV, so equal outputs mean equal prompts.
- `real`: the embedded default model on the CPU (byte tokenizer, logprobs), no template given:
  the front uses its documented default template.
`sim` is module-scoped, `real` (a few seconds to start) session-scoped; a test leaves its
stack idle (every block free) for the next.
"""

from __future__ import annotations

import dataclasses

import httpx
import openai
import pytest

from control_plane.scheduler_config import SchedulerConfig
from pagedkv.openai_api.chat_template import load_chat_template
from tests.grpc.conftest import ScriptedWorker
from tests.grpc.harness import Stack
from tests.openai.harness import TIMEOUT_S, HttpFront, hf_vocab_size, write_hf_model_dir


@dataclasses.dataclass
class Served:
    stack: Stack
    front: HttpFront
    model_dir: object = None
    hf_model: object = None  # transformers' model of the served checkpoint (hf_real)

    @property
    def model(self) -> str:
        return self.stack.client.model_info().facts.model_name

    def sdk(self, **kw) -> openai.OpenAI:
        """The openai SDK, no retries (a 429 or 503 must surface, not be retried away)."""
        kw.setdefault("api_key", "unused")
        return openai.OpenAI(base_url=self.front.base_url + "/v1", max_retries=0, timeout=TIMEOUT_S, **kw)

    def http(self) -> httpx.Client:
        return httpx.Client(base_url=self.front.base_url, timeout=TIMEOUT_S)

    def close(self) -> None:
        self.front.close()
        self.stack.close()


@pytest.fixture(scope="session")
def hf_model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf-tok")
    write_hf_model_dir(path)
    return path


def sim_worker_factory(model_dir, **kw):
    tokenizer_json = (model_dir / "tokenizer.json").read_text()

    def make():
        w = ScriptedWorker(tokenizer="hf", vocab_size=hf_vocab_size(model_dir), **kw)
        w._info = dataclasses.replace(w._info, tokenizer_json=tokenizer_json)
        return w

    return make


def serve_sim(
    model_dir, config: SchedulerConfig | None = None, worker: dict | None = None, **front
) -> Served:
    kw = {"num_blocks": 64, "block_size": 16, **(worker or {})}
    stack = Stack(sim_worker_factory(model_dir, **kw), config)
    try:
        template = load_chat_template(str(model_dir))
        http = HttpFront(stack.address, stack.loop, chat_template=template, **front)
    except BaseException:
        stack.close()
        raise
    return Served(stack, http, model_dir)


@pytest.fixture(scope="module")
def sim(hf_model_dir):
    served = serve_sim(hf_model_dir)
    yield served
    served.close()


@pytest.fixture(scope="session")
def real():
    from worker import Worker, WorkerConfig

    stack = Stack(lambda: Worker(WorkerConfig(num_blocks=128)))
    try:
        front = HttpFront(stack.address, stack.loop)
    except BaseException:
        stack.close()
        raise
    served = Served(stack, front)
    yield served
    served.close()


@pytest.fixture(scope="session")
def hf_real(tmp_path_factory):
    """A tiny random Qwen2 checkpoint with the harness's Hugging Face tokenizer (byte-level BPE,
    ChatML specials), served by the real CPU worker behind the front; `.hf_model` is
    transformers' own model of the same checkpoint: the oracle for logits and logprobs."""
    from tests.openai.harness import write_hf_checkpoint
    from worker import Worker, WorkerConfig

    path = tmp_path_factory.mktemp("hf-real")
    hf_model = write_hf_checkpoint(path)
    stack = Stack(lambda: Worker(WorkerConfig(model=str(path), num_blocks=128, block_size=16)))
    try:
        front = HttpFront(stack.address, stack.loop, chat_template=load_chat_template(str(path)))
    except BaseException:
        stack.close()
        raise
    served = Served(stack, front, path, hf_model)
    yield served
    served.close()
