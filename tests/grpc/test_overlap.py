"""Overlap scheduling on the served stack: the same concurrent workload through a control plane
with overlap (the default, and with 3 plans in flight) and one with `--no-overlap` gives
identical streams, no stream
carries anything after its finish, usage is exact, and nothing leaks; a worker lost while two
plans are in flight is recovered from like any other worker loss.

The worker is the SimWorker (tokens derived from the context read back through the block
tables), so a wrong table, copy or fed-forward token changes the tokens. The pool is small
enough that requests are preempted and recomputed.
"""

from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from base.v1 import engine_pb2
from control_plane.engine_loop import EngineOptions
from control_plane.sim_worker import reference_tokens
from tests.grpc.conftest import VOCAB
from tests.grpc.harness import in_thread

NUM_REQUESTS = 24
CLIENTS = 8
WORKER = dict(num_blocks=20, block_size=4, delay_s=0.001)
CONFIG = dict(max_num_seqs=8, max_num_batched_tokens=24)


def _workload(seed: int) -> list[dict]:
    """Requests with short and long max_tokens, n up to 3, stop ids taken from the reference
    output (so they do hit), and printable prompts (texts decode)."""
    rng = random.Random(seed)
    requests = []
    for i in range(NUM_REQUESTS):
        prompt = [rng.randrange(97, 123) for _ in range(rng.randrange(3, 14))]
        max_tokens = rng.choice([1, 2, 3, 8, 24])
        kw = dict(token_ids=prompt, max_tokens=max_tokens, n=rng.choice([1, 1, 2, 3]), request_id=f"r{i}")
        if max_tokens > 2 and rng.random() < 0.4:
            kw["stop_token_ids"] = [reference_tokens(prompt, 0, max_tokens, VOCAB)[rng.randrange(max_tokens)]]
        kw["seed"] = rng.randrange(1 << 30)
        requests.append(kw)
    return requests


def _run(stack, requests: list[dict]) -> dict[tuple[str, int], dict]:
    """Every request concurrently; per (request, index): tokens, text, finish, usage."""

    def one(kw) -> list:
        return list(stack.client.generate(ignore_eos=True, **kw))

    with ThreadPoolExecutor(CLIENTS) as pool:
        streams = list(pool.map(one, requests))
    samples: dict[tuple[str, int], dict] = {}
    for kw, messages in zip(requests, streams, strict=True):
        for m in messages:
            s = samples.setdefault((kw["request_id"], m.index), {"tokens": [], "text": "", "finish": 0})
            assert not s["finish"], f"{kw['request_id']}/{m.index}: a message after its finish: {m}"
            s["tokens"] += m.token_ids
            s["text"] += m.text
            if m.finish_reason:
                s["finish"] = m.finish_reason
                s["usage"] = (m.usage.prompt_tokens, m.usage.completion_tokens)
        for index in range(kw["n"]):
            s = samples[(kw["request_id"], index)]
            assert s["finish"], f"{kw['request_id']}/{index} never finished"
            assert s["usage"] == (len(kw["token_ids"]), len(s["tokens"])), (kw, index, s)
    return samples


def _check_against_reference(requests: list[dict], samples: dict) -> None:
    for kw in requests:
        for index in range(kw["n"]):
            s = samples[(kw["request_id"], index)]
            full = reference_tokens(kw["token_ids"], index, kw["max_tokens"], VOCAB)
            stops = set(kw.get("stop_token_ids", ()))
            cut = next((i + 1 for i, t in enumerate(full) if t in stops), len(full))
            assert s["tokens"] == full[:cut], (kw, index)
            stopped = cut < len(full) or (cut and full[cut - 1] in stops)
            expected = engine_pb2.FINISH_REASON_STOP if stopped else engine_pb2.FINISH_REASON_LENGTH
            assert s["finish"] == expected, (kw, index, s)


def _assert_nothing_leaked(stack) -> None:
    s = stack.wait_idle()
    assert s.num_blocks_free == s.num_blocks_total and s.num_running == 0 and s.num_waiting == 0
    deadline = time.monotonic() + 10
    while stack.worker.tables and time.monotonic() < deadline:  # the last drop travels in a plan
        time.sleep(0.01)
    assert not stack.worker.tables, f"the worker still mirrors {sorted(stack.worker.tables)}"


def test_overlap_streams_equal_the_strict_loop_under_concurrency(make_stack):
    overlap = make_stack(worker=WORKER, **CONFIG)
    strict = make_stack(worker=WORKER, options=EngineOptions(worker_grace_s=2.0, plans_in_flight=1), **CONFIG)
    deeper = make_stack(worker=WORKER, options=EngineOptions(worker_grace_s=2.0, plans_in_flight=3), **CONFIG)
    requests = _workload(seed=13)
    got = _run(overlap, requests)
    _check_against_reference(requests, got)
    assert got == _run(strict, requests)
    assert got == _run(deeper, requests)
    # Stop strings, matched on detokenized text after the step's tokens were streamed: with
    # overlap the next step has already run for that sample; its token must never show.
    texts = {kw["request_id"]: got[(kw["request_id"], 0)]["text"] for kw in requests}
    with_stops = []
    for kw in requests:
        text = texts[kw["request_id"]]
        stop = next((ch for ch in text[len(text) // 3 :] if ch.isalnum()), None)
        if stop is not None and kw["n"] == 1:
            with_stops.append({**kw, "stop": [stop], "request_id": kw["request_id"] + "s"})
    assert len(with_stops) >= 5, "the workload should exercise stop strings"
    got_stops = _run(overlap, with_stops)
    assert got_stops == _run(strict, with_stops)
    for kw in with_stops:
        s = got_stops[(kw["request_id"], 0)]
        assert kw["stop"][0] not in s["text"]
        full_text = texts[kw["request_id"][:-1]]
        if s["finish"] == engine_pb2.FINISH_REASON_STOP:
            assert full_text.startswith(s["text"]) and full_text[len(s["text"])] == kw["stop"][0]
    for stack in (overlap, strict, deeper):
        _assert_nothing_leaked(stack)
    assert overlap.client.stats().num_preemptions > 0, "the pool should be tight enough to preempt"


def _two_plans_in_flight(stack) -> bool:
    return stack.on_loop(lambda: stack.engine.worker.num_in_flight) == 2


@pytest.mark.parametrize("comes_back", [True, False], ids=["restarted-within-grace", "stays-down"])
def test_worker_lost_with_two_plans_in_flight(make_stack, comes_back):
    stack = make_stack(worker=dict(delay_s=0.002), options=EngineOptions(worker_grace_s=1.0))
    prompt = list(range(1, 30))
    t, box = in_thread(lambda: list(stack.client.generate(token_ids=prompt, max_tokens=60, n=2)))
    deadline = time.monotonic() + 20
    while stack.client.stats().num_steps < 5:
        assert time.monotonic() < deadline, "the request never ran"
        time.sleep(0.005)
    stack.worker.gate.clear()  # the worker holds its current plan; the next one is sent behind it
    while not _two_plans_in_flight(stack):
        assert time.monotonic() < deadline, "overlap never had two plans in flight"
        time.sleep(0.005)
    stack.call(stack.worker_server.stop(0))
    stack.worker.gate.set()  # let the held step end so the executor can shut down
    stack.servicer.close()
    stack.worker_server = None
    if comes_back:
        stack.restart_worker()  # a new instance: mirrors gone, both samples are recomputed
    t.join(30)
    assert not t.is_alive()
    if comes_back:
        assert "error" not in box, box
        for index in (0, 1):
            tokens = [tok for m in box["result"] if m.index == index for tok in m.token_ids]
            assert tokens == reference_tokens(prompt, index, 60, VOCAB)
        assert stack.wait_idle().num_preemptions >= 1
    else:
        assert box["error"].code == grpc.StatusCode.UNAVAILABLE, box
        s = stack.client.stats()
        assert s.num_live_requests == 0 and s.num_blocks_free == s.num_blocks_total
        stack.restart_worker()
    stack.client.wait_ready(10)
    (c,) = stack.client.complete(token_ids=prompt, max_tokens=8)
    assert c.token_ids == reference_tokens(prompt, 0, 8, VOCAB)
    _assert_nothing_leaked(stack)
