"""Every client error the issue lists, asserted by status code; after each, the server still
serves a request correctly and no block leaked (free == total - 1, the null block)."""

from __future__ import annotations

import grpc
import pytest

from base.v1 import engine_pb2
from control_plane.sim_worker import reference_tokens
from pagedkv.client import ClientError
from tests.grpc.conftest import VOCAB

OK_PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]


def _expect(code: grpc.StatusCode, fn, *args, match: str = "", **kw) -> str:
    with pytest.raises(ClientError) as e:
        fn(*args, **kw)
    assert e.value.code == code, e.value
    assert match.lower() in e.value.details.lower(), e.value.details
    return e.value.details


def _still_healthy(stack) -> None:
    (c,) = stack.client.complete(token_ids=OK_PROMPT, max_tokens=6)
    assert c.token_ids == reference_tokens(OK_PROMPT, 0, 6, VOCAB)
    stats = stack.wait_idle()
    assert stats.num_blocks_free == stack.client.model_info().facts.num_blocks - 1


BAD = grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.parametrize(
    ("request_kwargs", "match"),
    [(dict(text="hi", token_ids=[1, 2]), "not both"), (dict(), "empty"), (dict(text=""), "empty")],
)
def test_prompt_needs_exactly_one_of_text_and_token_ids(stack, request_kwargs, match):
    req = engine_pb2.GenerateRequest(sampling=engine_pb2.SamplingParams(max_tokens=3), **request_kwargs)
    _expect(BAD, lambda: list(stack.client.generate_request(req)), match=match)
    _still_healthy(stack)


@pytest.mark.parametrize(
    ("request_kwargs", "match"),
    [
        (dict(token_ids=[1, VOCAB]), f"token id {VOCAB}"),
        (dict(token_ids=[1, 2], max_tokens=0), "max_tokens"),
        (dict(token_ids=[1, 2], max_tokens=4095), "max length"),  # above the limit
        (dict(token_ids=[1] * 4097, max_tokens=1), "max length"),  # prompt too long
        (dict(token_ids=[1, 2], temperature=-1.0), "temperature"),
        (dict(token_ids=[1, 2], temperature=float("nan")), "temperature"),
        (dict(token_ids=[1, 2], top_p=1.5), "top_p"),
        (dict(token_ids=[1, 2], n=17), "n must be"),
        (dict(token_ids=[1, 2], stop=[""]), "stop string"),
        (dict(token_ids=[1, 2], stop=["x"] * 17), "stop strings"),
    ],
)
def test_invalid_requests(stack, request_kwargs, match):
    kw = {"max_tokens": 4, **request_kwargs}
    _expect(BAD, stack.client.complete, **kw, match=match)
    _still_healthy(stack)


def test_text_and_stop_strings_need_a_tokenizer(make_stack):
    stack = make_stack(worker=dict(tokenizer="none"))
    _expect(BAD, stack.client.complete, "hello", max_tokens=3, match="token_ids")
    _expect(BAD, stack.client.complete, token_ids=[1], max_tokens=3, stop=["a"], match="tokenizer")
    _still_healthy(stack)


def test_n_above_the_running_limit(make_stack):
    stack = make_stack(max_num_seqs=4)
    _expect(BAD, stack.client.complete, token_ids=[1, 2], max_tokens=3, n=5, match="lower n")
    assert stack.client.model_info().max_n == 4
    _still_healthy(stack)


def test_request_that_can_never_fit_the_pool(make_stack):
    stack = make_stack(worker=dict(num_blocks=8))  # 7 real blocks = 112 tokens
    _expect(
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        stack.client.complete,
        token_ids=[1] * 50,
        max_tokens=100,
        match="lower max_tokens",
    )
    _still_healthy(stack)


def test_queue_full(make_stack):
    stack = make_stack(max_num_seqs=1, max_queue=1)
    stack.worker.gate.clear()  # hold the first step: one running, then one waiting
    running = stack.client.generate(token_ids=[1, 2], max_tokens=50, request_id="a")
    waiting = stack.client.generate(token_ids=[3, 4], max_tokens=50, request_id="b")
    import threading

    got = {}
    threads = [
        threading.Thread(target=lambda it=it, k=k: got.setdefault(k, list(it)))
        for k, it in (("a", running), ("b", waiting))
    ]
    for t in threads:
        t.start()
    _wait(lambda: stack.client.stats().num_waiting == 1 and stack.client.stats().num_live_requests == 2)
    _expect(
        grpc.StatusCode.RESOURCE_EXHAUSTED, stack.client.complete, token_ids=[5], max_tokens=3, match="queue"
    )
    stack.worker.gate.set()
    for t in threads:
        t.join(20)
    assert got["a"][-1].finish_reason == engine_pb2.FINISH_REASON_LENGTH
    assert got["b"][-1].finish_reason == engine_pb2.FINISH_REASON_LENGTH
    _still_healthy(stack)


def test_duplicate_live_request_id(make_stack):
    stack = make_stack()
    stack.worker.gate.clear()
    it = stack.client.generate(token_ids=[1, 2], max_tokens=5, request_id="dup")
    import threading

    t = threading.Thread(target=lambda: list(it))
    t.start()
    _wait(lambda: stack.client.stats().num_live_requests == 1)
    _expect(
        grpc.StatusCode.ALREADY_EXISTS, stack.client.complete, token_ids=[1], max_tokens=2, request_id="dup"
    )
    stack.worker.gate.set()
    t.join(20)
    _still_healthy(stack)


def test_unknown_request_ids_are_not_found(stack):
    _expect(grpc.StatusCode.NOT_FOUND, stack.client.abort, "nope", match="nope")
    _expect(grpc.StatusCode.NOT_FOUND, stack.client.block_table, "nope", match="nope")
    stack.client.complete(token_ids=[1], max_tokens=2, request_id="finished")
    _expect(grpc.StatusCode.NOT_FOUND, stack.client.abort, "finished")
    _still_healthy(stack)


def _wait(cond, timeout: float = 10.0) -> None:
    import time

    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached")
        time.sleep(0.01)
