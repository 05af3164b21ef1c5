"""Both services in-process over real channels: streaming, n > 1, abort, cancellation, stats,
block tables, stop strings, text. Tokens are checked against SimWorker's unpaged reference,
so a paging or transport bug changes them."""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from base.v1 import engine_pb2
from control_plane.sim_worker import reference_tokens
from pagedkv.client import AsyncClient, ClientError
from tests.grpc.conftest import VOCAB

PROMPT = [7, 1, 8, 2, 8, 1, 8, 2, 8, 4, 5, 9, 0, 4, 5, 2, 3, 5, 3, 6]  # 20 tokens: 2 blocks


def _ref(prompt, index, max_tokens):
    return reference_tokens(prompt, index, max_tokens, VOCAB)


def test_stream_delivers_reference_tokens_one_message_per_step(stack):
    msgs = list(stack.client.generate(token_ids=PROMPT, max_tokens=12))
    assert [len(m.token_ids) for m in msgs] == [1] * 12
    assert [t for m in msgs for t in m.token_ids] == _ref(PROMPT, 0, 12)
    assert all(m.finish_reason == 0 and not m.HasField("usage") for m in msgs[:-1])
    last = msgs[-1]
    assert last.finish_reason == engine_pb2.FINISH_REASON_LENGTH
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (20, 12)
    assert len({m.request_id for m in msgs}) == 1 and msgs[0].request_id
    stack.wait_idle()


def test_n_samples_stream_with_their_index_and_share_prompt_blocks(stack):
    done = stack.client.complete(token_ids=PROMPT * 2, max_tokens=9, n=4, request_id="fan")
    assert [c.index for c in done] == [0, 1, 2, 3]
    for c in done:
        assert c.token_ids == _ref(PROMPT * 2, c.index, 9)
        assert c.finish_reason == "LENGTH" and c.usage.completion_tokens == 9
    assert len({tuple(c.token_ids) for c in done}) == 4
    stack.wait_idle()


def test_concurrent_streams_are_batched_and_all_correct(stack):
    prompts = {f"r{i}": [i + 1] * (5 + i) for i in range(12)}
    results: dict[str, list[int]] = {}

    def run(rid):
        (c,) = stack.client.complete(token_ids=prompts[rid], max_tokens=15, request_id=rid)
        results[rid] = c.token_ids

    threads = [threading.Thread(target=run, args=(rid,)) for rid in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert results == {rid: _ref(p, 0, 15) for rid, p in prompts.items()}
    s = stack.wait_idle()
    assert s.num_steps < 12 * 16  # batched: far fewer steps than one request at a time


def test_text_prompt_streams_utf8_safe_text_and_stop_strings_cut(stack):
    (c,) = stack.client.complete("héllo wörld, " * 3, max_tokens=40)
    assert c.text.encode("utf-8", "strict")  # never a broken character
    # Use the first two characters of the output as a stop string: the text must end before it.
    target = next((c.text[i : i + 2] for i in range(len(c.text) - 1) if c.text[i : i + 2].strip()), None)
    if target is None:
        pytest.skip("the sim produced no printable pair")
    (s,) = stack.client.complete("héllo wörld, " * 3, max_tokens=40, stop=[target])
    assert s.finish_reason == "STOP"
    assert s.text == c.text[: c.text.index(target)]
    assert s.usage.completion_tokens <= c.usage.completion_tokens
    stack.wait_idle()


def test_abort_ends_every_sample_with_abort_and_frees_blocks(make_stack):
    stack = make_stack(worker=dict(delay_s=0.01))
    it = stack.client.generate(token_ids=PROMPT, max_tokens=500, n=2, request_id="victim")
    first = next(it)
    assert first.request_id == "victim"
    assert stack.client.abort("victim") >= 1
    rest = list(it)
    finals = {m.index: m.finish_reason for m in [first, *rest] if m.finish_reason}
    assert set(finals.values()) == {engine_pb2.FINISH_REASON_ABORT} and len(finals) == 2
    stack.wait_idle()


def test_client_cancellation_aborts_within_a_step(make_stack):
    stack = make_stack(worker=dict(delay_s=0.02))
    it = stack.client.generate(token_ids=PROMPT, max_tokens=600, request_id="gone")
    next(it)
    assert stack.client.stats().num_running == 1
    steps_before = stack.client.stats().num_steps
    it.close()  # cancels the RPC
    s = stack.wait_idle(timeout=5)
    assert s.num_steps - steps_before <= 3  # freed within a step or two of the cancel
    with pytest.raises(ClientError) as e:
        stack.client.abort("gone")
    assert e.value.code == grpc.StatusCode.NOT_FOUND


def test_deadline_exceeded_aborts_the_request(make_stack):
    stack = make_stack(worker=dict(delay_s=0.02))
    with pytest.raises(ClientError) as e:
        list(stack.client.generate(token_ids=PROMPT, max_tokens=600, timeout=0.3))
    assert e.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    stack.wait_idle(timeout=5)


def test_block_table_of_a_live_request_shows_paging(make_stack):
    stack = make_stack(worker=dict(delay_s=0.01))
    it = stack.client.generate(token_ids=PROMPT * 3, max_tokens=200, n=2, request_id="bt")
    for _ in range(3):
        next(it)
    table = stack.client.block_table("bt")
    assert table.request_id == "bt" and table.block_size == 16
    assert [s.index for s in table.sequences] == [0, 1]
    for seq in table.sequences:
        assert 0 not in seq.block_ids
        assert len(seq.block_ids) * 16 >= seq.num_tokens > 60
    a, b = (list(s.block_ids) for s in table.sequences)
    assert a[:3] == b[:3]  # the 3 full prompt blocks are shared by both samples
    stats = stack.client.stats()
    assert stats.ref_count_histogram[2] >= 3
    it.close()
    stack.wait_idle()


def test_stats_and_model_info_report_the_pool(stack):
    info = stack.client.model_info()
    assert (info.facts.num_blocks, info.facts.block_size, info.facts.vocab_size) == (64, 16, VOCAB)
    assert info.facts.kv_layout == engine_pb2.KV_LAYOUT_PAGED and info.facts.tokenizer_kind == "byte"
    stack.client.complete(token_ids=PROMPT, max_tokens=4)
    stack.client.complete(token_ids=PROMPT, max_tokens=4)
    s = stack.wait_idle()
    assert s.num_blocks_free == s.num_blocks_total == info.facts.num_blocks - 1
    assert s.prefix_cache_hits >= 16 and 0 < s.prefix_cache_hit_rate < 1
    assert s.num_finished_requests == 2 and s.worker_available


def test_health_is_serving(stack):
    assert stack.client.health() == "SERVING"
    assert stack.client.health("pagedkv.v1.Engine") == "SERVING"


def test_async_client_streams_and_queries(stack):
    async def run():
        async with AsyncClient(stack.address) as c:
            msgs = [m async for m in c.generate(token_ids=PROMPT, max_tokens=5)]
            stats = await c.stats()
            return msgs, stats, await c.health()

    import asyncio

    msgs, stats, health = asyncio.run(run())
    assert [t for m in msgs for t in m.token_ids] == _ref(PROMPT, 0, 5)
    assert stats.num_blocks_total == 63 and health == "SERVING"


def test_async_client_wait_ready_waits_for_serving(make_stack):
    """Like Client.wait_ready: returns once health is SERVING, else TimeoutError naming the last
    status (NOT_SERVING while the worker is gone, UNAVAILABLE with nobody listening)."""
    import asyncio

    from control_plane.engine_loop import EngineOptions

    stack = make_stack(options=EngineOptions(worker_grace_s=0.2))
    stack.kill_worker()
    with pytest.raises(ClientError):  # the loss is noticed at the next step
        stack.client.complete(token_ids=PROMPT, max_tokens=2)
    deadline = time.monotonic() + 60  # a hang guard only
    while stack.client.health() != "NOT_SERVING":
        assert time.monotonic() < deadline
        time.sleep(0.02)

    async def run():
        async with AsyncClient(stack.address) as c:
            with pytest.raises(TimeoutError, match=r"not SERVING .*\(last: NOT_SERVING\)"):
                await c.wait_ready(timeout=0.3)
            waiting = asyncio.ensure_future(c.wait_ready(timeout=60))
            await asyncio.sleep(0.1)
            assert not waiting.done()  # the worker is still down
            await asyncio.to_thread(stack.restart_worker)
            await waiting
            return await c.health()

    assert asyncio.run(run()) == "SERVING"

    async def unreachable():
        async with AsyncClient("127.0.0.1:1") as c:  # loopback, nothing listens on port 1
            with pytest.raises(TimeoutError, match=r"\(last: UNAVAILABLE\)"):
                await c.wait_ready(timeout=0.5)

    asyncio.run(unreachable())


def test_idle_engine_does_not_step(stack):
    stack.client.complete(token_ids=PROMPT, max_tokens=3)
    before = stack.wait_idle().num_steps
    time.sleep(0.3)
    assert stack.client.stats().num_steps == before
