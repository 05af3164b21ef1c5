"""The HTTP front in the test process: uvicorn on a background thread, 127.0.0.1:0, in front of
a `tests.grpc.harness.Stack` (control plane + worker on loopback / a Unix socket).

`hf_model_dir` writes a tiny Hugging Face tokenizer (byte-level BPE: 256 byte tokens and the
special tokens below) with a ChatML chat template that uses them, so chat tests can prove
special tokens in a template reach the engine as single ids.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path

import uvicorn

from pagedkv.openai_api.app import create_app
from pagedkv.openai_api.front import Front

TIMEOUT_S = 60.0  # a hang guard only
SPECIAL_TOKENS = ("<|im_start|>", "<|im_end|>", "<|endoftext|>")
CHATML_TEMPLATE = (
    "{% if messages[0]['role'] != 'system' %}{{ bos_token }}{% endif %}"
    "{% for message in messages %}\n"
    "  {% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + message['role']) }}{% endif %}\n"
    "  {{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}\n"
    "{% endfor %}\n"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


class HttpFront:
    """`create_app(Front(...))` served by uvicorn on `loop` (a Stack's loop: one event loop for
    the engine's servers and the front's gRPC channel, as in a one-loop process; several
    grpc.aio loops in one process are best kept few), or on a loop thread of its own."""

    def __init__(
        self, engine_address: str, loop: asyncio.AbstractEventLoop | None = None, **front_kwargs
    ) -> None:
        self.front = Front(engine_address, **front_kwargs)
        config = uvicorn.Config(
            create_app(self.front),
            host="127.0.0.1",
            port=0,
            log_config=None,
            access_log=False,
            timeout_graceful_shutdown=1,
        )
        self.server = uvicorn.Server(config)
        self._own_loop = loop is None
        if loop is None:
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="test-http-front", daemon=True).start()
        self.loop = loop
        self._serving = asyncio.run_coroutine_threadsafe(self.server.serve(), loop)
        deadline = time.monotonic() + TIMEOUT_S
        while not self.server.started:
            if self._serving.done() or time.monotonic() > deadline:
                raise RuntimeError(f"the HTTP front did not start: {self._serving}")
            time.sleep(0.01)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        self.base_url = f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        self.server.should_exit = True
        self._serving.result(TIMEOUT_S)
        if self._own_loop:
            self.loop.call_soon_threadsafe(self.loop.stop)


def write_hf_model_dir(path: Path) -> list[int]:
    """tokenizer.json + tokenizer_config.json (ChatML template) at `path`; returns the special
    tokens' ids. The vocabulary: 256 byte tokens, then SPECIAL_TOKENS."""
    from bench.vl_checkpoint import write_byte_bpe_tokenizer

    tok = write_byte_bpe_tokenizer(path, SPECIAL_TOKENS)
    config = {
        "bos_token": {  # the AddedToken form older checkpoints use: a dict
            "__type": "AddedToken",
            "content": "<|endoftext|>",
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "single_word": False,
            "special": True,
        },
        "eos_token": "<|im_end|>",
        "chat_template": CHATML_TEMPLATE,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return [tok.token_to_id(t) for t in SPECIAL_TOKENS]


def hf_vocab_size(path: Path) -> int:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path / "tokenizer.json")).get_vocab_size(with_added_tokens=True)


def write_hf_checkpoint(path: Path):
    """A tiny random Qwen2 checkpoint whose vocabulary is `write_hf_model_dir`'s tokenizer,
    saved with that tokenizer at `path` (EOS: <|im_end|>); returns transformers' model read
    back from it (its generate() ignores EOS: see build_checkpoint)."""
    from tests.worker.worker_test_utils import CheckpointSpec, build_checkpoint

    im_end = write_hf_model_dir(path)[1]
    geometry = {"vocab_size": hf_vocab_size(path), "max_position_embeddings": 512, "eos_token_id": im_end}
    return build_checkpoint(path, CheckpointSpec("Qwen2Config", geometry))
