"""Logprobs and logit shaping through the served gRPC stack (control plane + the real CPU worker
on a tiny Qwen2 checkpoint with a Hugging Face tokenizer), against transformers' own model of
that checkpoint: prompt logprobs assembled over prefill chunks and shared by n samples, top
logprobs per sample, min_tokens holding off stop strings."""

from __future__ import annotations

import pytest
import torch

from base.tokenizer import HFTokenizer
from control_plane.scheduler_config import SchedulerConfig
from tests.grpc.harness import Stack
from tests.openai.harness import write_hf_checkpoint

REL, ABS = 1e-4, 1e-5


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """Chunks of at most 16 tokens per sequence per step: a long prompt's logprobs arrive in pieces."""
    from worker import Worker, WorkerConfig

    path = tmp_path_factory.mktemp("hf-grpc")
    hf_model = write_hf_checkpoint(path)
    config = SchedulerConfig(long_prefill_token_threshold=16)
    stack = Stack(lambda: Worker(WorkerConfig(model=str(path), num_blocks=96, block_size=16)), config)
    stack.hf_model = hf_model
    stack.tokenizer = HFTokenizer((path / "tokenizer.json").read_text())
    yield stack
    stack.close()


def hf_logprobs(stack, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(stack.hf_model(torch.tensor([ids])).logits[0].float(), dim=-1)


PROMPT = "Prompt logprobs must survive chunked prefill: every chunk's positions, in order, once."


def test_prompt_logprobs_over_chunks_shared_by_every_sample(served):
    ids = served.tokenizer.encode(PROMPT)
    assert len(ids) > 40  # three chunks or more
    out = served.client.complete(PROMPT, max_tokens=3, n=2, temperature=0.8, seed=1, prompt_logprobs=2)
    served.wait_idle()
    want = hf_logprobs(served, ids)
    for sample in out:
        entries = sample.prompt_logprobs
        assert [e.token_id for e in entries] == ids
        assert not entries[0].HasField("logprob")
        for p in range(1, len(ids)):
            assert entries[p].logprob == pytest.approx(float(want[p - 1, ids[p]]), rel=REL, abs=ABS)
            values, top = torch.topk(want[p - 1], 2)
            assert list(entries[p].top.token_ids) == top.tolist()
            assert list(entries[p].top.logprobs) == pytest.approx(values.tolist(), rel=REL, abs=ABS)
    assert served.client.stats().num_blocks_free == served.client.stats().num_blocks_total


def test_top_logprobs_of_every_sample_are_its_positions_raw_distribution(served):
    ids = served.tokenizer.encode("top logprobs per sample")
    out = served.client.complete(
        token_ids=ids,
        max_tokens=5,
        n=3,
        temperature=1.0,
        seed=3,
        logprobs=True,
        top_logprobs=4,
        ignore_eos=True,
    )
    served.wait_idle()
    for sample in out:
        want = hf_logprobs(served, ids + list(sample.token_ids))
        assert len(sample.top_logprobs) == len(sample.token_ids) == 5
        for i, (token, lp, top) in enumerate(
            zip(sample.token_ids, sample.logprobs, sample.top_logprobs, strict=True)
        ):
            row = want[len(ids) - 1 + i]
            assert lp == pytest.approx(float(row[token]), rel=REL, abs=ABS)
            values, best = torch.topk(row, 4)
            assert list(top.token_ids) == best.tolist()
            assert list(top.logprobs) == pytest.approx(values.tolist(), rel=REL, abs=ABS)


def test_min_tokens_holds_off_stop_strings_and_stop_ids(served):
    """Token "a" forced by logit_bias; stop string "a" ends the sample at its first token, unless
    min_tokens says how many must come first (the stop string is then matched after them)."""
    a = served.tokenizer.encode("a")[0]
    kw = dict(max_tokens=10, logit_bias={a: 100.0}, ignore_eos=True)
    early = served.client.complete("x", stop=["a"], **kw)[0]
    held = served.client.complete("x", stop=["a"], min_tokens=3, **kw)[0]
    by_id = served.client.complete("x", stop_token_ids=[a], min_tokens=4, **kw)[0]
    served.wait_idle()
    assert (early.text, early.finish_reason, early.usage.completion_tokens) == ("", "STOP", 1)
    assert (held.text, held.finish_reason, held.usage.completion_tokens) == ("aaa", "STOP", 4)
    assert by_id.finish_reason == "STOP" and by_id.usage.completion_tokens == 5


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
        ({"prompt_logprobs": 21}, "prompt_logprobs"),
        ({"logit_bias": {100000: 1.0}}, "outside the vocabulary"),
        ({"min_tokens": 20}, "min_tokens (20) must be <= max_tokens (4)"),
        ({"presence_penalty": 2.5}, "presence_penalty must be in [-2, 2]"),
    ],
)
def test_bad_sampling_fields_are_invalid_argument_before_any_block(served, fields, message):
    from pagedkv.client import ClientError

    before = served.client.stats().blocks_allocated_total
    with pytest.raises(ClientError) as e:
        served.client.complete("x", max_tokens=4, **fields)
    assert e.value.code.name == "INVALID_ARGUMENT" and message in e.value.details
    assert served.client.stats().blocks_allocated_total == before
