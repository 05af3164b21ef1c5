"""Beam search through the served stack (real servers and channels, the paging-checking
SimWorker): the message order the proto documents, tokens and scores equal to an unpaged
reference, shared blocks visible in GetBlockTable / GetStats mid-search, Abort and a closed
stream freeing every block, and clear errors for requests beam search cannot take."""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from base.v1 import engine_pb2
from control_plane.beam_search import BeamSearch, f32
from control_plane.sim_worker import reference_beams
from pagedkv.client import ClientError, build_request
from tests.grpc.conftest import VOCAB
from tests.grpc.harness import TIMEOUT_S, Stack

PROMPT = list(range(3, 43))  # 40 tokens: two full blocks of 16 that every beam shares
WAIT_S = 30.0  # a hang guard only


def expected(width: int, n: int, max_tokens: int, lp: float, stops=frozenset()):
    return reference_beams(PROMPT, BeamSearch(width, lp, max_tokens, stops), VOCAB)[:n]


def test_final_messages_only_best_first_equal_to_the_unpaged_reference(stack):
    stop = expected(4, 1, 12, 1.0)[0].token_ids[5]  # a token the search meets
    messages = list(
        stack.client.generate(
            token_ids=PROMPT, max_tokens=12, beam_width=4, n=3, stop_token_ids=[stop], logprobs=True
        )
    )
    want = expected(4, 3, 12, 1.0, frozenset({stop}))
    assert [m.index for m in messages] == [0, 1, 2]
    for m, h in zip(messages, want, strict=True):
        assert list(m.token_ids) == h.token_ids
        assert m.finish_reason == (
            engine_pb2.FINISH_REASON_STOP if h.stopped else engine_pb2.FINISH_REASON_LENGTH
        )
        assert m.usage.prompt_tokens == len(PROMPT) and m.usage.completion_tokens == len(h.token_ids)
        assert m.cumulative_logprob == f32(h.cumulative_logprob) and m.beam_score == f32(h.score)
        assert list(m.logprobs) == pytest.approx(h.logprobs, abs=1e-6)
    assert [m.beam_score for m in messages] == sorted((m.beam_score for m in messages), reverse=True)
    assert stack.wait_idle().num_blocks_free == stack.wait_idle().num_blocks_total


def run_steps(stack: Stack, count: int) -> None:
    before = stack.worker.num_executes
    stack.worker.permits.release(count)
    deadline = time.monotonic() + WAIT_S
    while stack.worker.num_executes < before + count:
        assert time.monotonic() < deadline, "the engine stopped stepping"
        time.sleep(0.005)


def shared_blocks(table: engine_pb2.BlockTable) -> set[int]:
    seen, shared = set(), set()
    for seq in table.sequences:
        for block in seq.block_ids:
            (shared if block in seen else seen).add(block)
    return shared


@pytest.mark.parametrize("end", ["abort", "cancel"])
def test_shared_blocks_visible_mid_search_and_freed_by_abort_or_cancel(stepped_stack, end):
    stepped = stepped_stack
    request = build_request(token_ids=PROMPT, max_tokens=40, beam_width=4, n=2, request_id="beams")
    call = stepped.client._stub.Generate(request, timeout=TIMEOUT_S)
    received = []
    reader = threading.Thread(target=lambda: received.extend(_drain(call)))
    reader.start()
    run_steps(stepped, 6)  # the prompt, then five selections
    table = stepped.client.block_table("beams")
    assert len(table.sequences) == 4 and [s.index for s in table.sequences] == [0, 1, 2, 3]
    assert {table.sequences[0].block_ids[0], table.sequences[0].block_ids[1]} <= shared_blocks(table)
    stats = stepped.client.stats()
    assert max(stats.ref_count_histogram) == 4  # the prompt's full blocks: one copy, four holders
    total = stats.num_blocks_total
    in_use = total - stats.num_blocks_free
    assert in_use == len({b for s in table.sequences for b in s.block_ids})
    if end == "abort":
        assert stepped.client.abort("beams") == 2
    else:
        call.cancel()
    stepped.worker.permits.release(1000)
    reader.join(WAIT_S)
    assert stepped.wait_idle().num_blocks_free == total
    if end == "abort":
        assert [(m.index, m.finish_reason, list(m.token_ids)) for m in received] == [
            (0, engine_pb2.FINISH_REASON_ABORT, []),
            (1, engine_pb2.FINISH_REASON_ABORT, []),
        ]


def _drain(call):
    try:
        yield from call
    except grpc.RpcError as e:
        assert e.code() == grpc.StatusCode.CANCELLED


@pytest.mark.parametrize(
    "fields, code, words",
    [
        (dict(temperature=0.7), "INVALID_ARGUMENT", "greedy"),
        (dict(top_k=5), "INVALID_ARGUMENT", "greedy"),
        (dict(seed=3), "INVALID_ARGUMENT", "greedy"),
        (dict(n=5), "INVALID_ARGUMENT", "beams returned"),
        (dict(beam_width=17, n=1), "INVALID_ARGUMENT", "beam_width"),
        (dict(stop=["x"]), "INVALID_ARGUMENT", "stop strings"),
        (dict(max_tokens=300), "RESOURCE_EXHAUSTED", "4 beams"),  # 4 x 22 blocks > 63
    ],
)
def test_requests_beam_search_cannot_take(stack, fields, code, words):
    kw = {"token_ids": PROMPT, "max_tokens": 8, "beam_width": 4, "n": 2, **fields}
    with pytest.raises(ClientError) as err:
        list(stack.client.generate(**kw))
    assert err.value.code.name == code and words in err.value.details, err.value.details
    assert stack.client.model_info().max_beam_width == 16
    stack.wait_idle()
