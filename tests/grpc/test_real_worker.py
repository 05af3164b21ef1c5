"""The real default-model worker behind gRPC: greedy tokens equal the worker driven directly,
in-process (same scheduler, no transport), for single requests, a concurrent batch and n > 1."""

from __future__ import annotations

import threading

import pytest

from base.plan import SamplingParams
from control_plane.engine import EngineCore
from control_plane.scheduler_config import SchedulerConfig

PROMPTS = {
    "short": list(b"Hello"),
    "two-blocks": list(b"The quick brown fox jumps over the lazy dog."),
    "long": list(b"paged attention " * 12),
}


@pytest.fixture(scope="module")
def direct_tokens():
    """Tokens from EngineCore(Worker) in-process: the oracle for the gRPC path."""
    from worker import Worker, WorkerConfig

    engine = EngineCore(Worker(WorkerConfig(num_blocks=256)), SchedulerConfig())
    for rid, prompt in PROMPTS.items():
        engine.add_request(rid, prompt, SamplingParams(max_tokens=24, ignore_eos=True))
    engine.add_request("fan", PROMPTS["two-blocks"], SamplingParams(max_tokens=10, n=3, ignore_eos=True))
    return engine.run_to_completion()


def test_greedy_tokens_through_grpc_equal_the_direct_worker(real_stack, direct_tokens):
    for rid, prompt in PROMPTS.items():
        (c,) = real_stack.client.complete(token_ids=prompt, max_tokens=24, ignore_eos=True)
        assert c.token_ids == direct_tokens[(rid, 0)], rid
        assert c.finish_reason == "LENGTH"
    real_stack.wait_idle()


def test_concurrent_greedy_batch_equals_the_direct_worker(real_stack, direct_tokens):
    got: dict[str, list[int]] = {}

    def run(rid):
        (c,) = real_stack.client.complete(token_ids=PROMPTS[rid], max_tokens=24, ignore_eos=True)
        got[rid] = c.token_ids

    threads = [threading.Thread(target=run, args=(rid,)) for rid in PROMPTS]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert got == {rid: direct_tokens[(rid, 0)] for rid in PROMPTS}
    real_stack.wait_idle()


def test_n_greater_than_one_equals_the_direct_worker(real_stack, direct_tokens):
    done = real_stack.client.complete(token_ids=PROMPTS["two-blocks"], max_tokens=10, n=3, ignore_eos=True)
    assert [c.token_ids for c in done] == [direct_tokens[("fan", i)] for i in range(3)]
    real_stack.wait_idle()


def test_text_prompt_equals_its_byte_tokens_and_logprobs_arrive(real_stack):
    (by_text,) = real_stack.client.complete("Hello", max_tokens=8, ignore_eos=True, logprobs=True)
    (by_ids,) = real_stack.client.complete(token_ids=list(b"Hello"), max_tokens=8, ignore_eos=True)
    assert by_text.token_ids == by_ids.token_ids
    assert len(by_text.logprobs) == 8 and all(lp <= 0.0 for lp in by_text.logprobs)
    expected_text = bytes(t for t in by_text.token_ids if t < 256).decode("utf-8", "replace")
    assert by_text.text == expected_text.rstrip("\ufffd")


def test_seeded_sampling_is_reproducible(real_stack):
    kw = dict(token_ids=PROMPTS["short"], max_tokens=12, temperature=1.0, seed=1234, ignore_eos=True)
    a = real_stack.client.complete(**kw)[0].token_ids
    b = real_stack.client.complete(**kw)[0].token_ids
    assert a == b
    real_stack.wait_idle()
