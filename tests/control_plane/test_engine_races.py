"""Races in the overlapped loop's window between update(k) and streaming step k's outputs
(while step k+2 is sent): the tokens are in the sequences, a finished request is retired and
its id free, but nothing has reached the streams. The CI soak found two:
  - an Abort in the window streamed its finish before those tokens, whose usage counted
    them ("usage says 6 tokens, received 5");
  - a request reusing a just-retired id in the window got the old request's last outputs,
    and the old stream never ended.
Here the window is held open on purpose: the worker is a SimWorker behind an in-process
AsyncWorker whose `send` can be paused.
"""

from __future__ import annotations

import asyncio
from collections import deque

from base.plan import Plan, SamplingParams, StepResult
from control_plane.engine_loop import AsyncEngine, EngineOptions
from control_plane.request import FinishReason
from control_plane.scheduler_config import SchedulerConfig
from control_plane.sim_worker import SimWorker


class PausableSimWorker:
    """AsyncWorker over a SimWorker, executing each plan as it is sent. After `pause_sends()`
    the next send (one made after a result was received: the overlap window) waits on `gate`."""

    target = "in-process-sim"

    def __init__(self) -> None:
        self.sim = SimWorker(num_blocks=32, block_size=4, vocab_size=100)
        self.results: deque[StepResult] = deque()
        self.ready = asyncio.Event()
        self.pause_next = False
        self.pause_when = None  # or a predicate: pause the first send made while it holds
        self.paused = asyncio.Event()
        self.gate = asyncio.Event()

    def pause_sends(self) -> None:
        self.pause_next = True

    async def describe(self, timeout: float | None = None):
        return self.sim.describe()

    async def reset(self, timeout: float | None = None) -> str:
        self.sim.reset()
        return self.sim.describe().instance_id

    def hold_lease(self, on_lost) -> None:
        pass

    async def list_adapters(self) -> list:
        return []

    async def send(self, plan: Plan, expected_instance_id: str = "") -> None:
        if self.pause_when is not None and self.pause_when():
            self.pause_next, self.pause_when = True, None
        if self.pause_next:
            self.pause_next = False
            self.paused.set()
            await self.gate.wait()
        self.results.append(self.sim.execute(plan))
        self.ready.set()
        await asyncio.sleep(0)

    async def receive(self) -> StepResult:
        while not self.results:
            self.ready.clear()
            await self.ready.wait()
        return self.results.popleft()

    async def close(self) -> None:
        pass


async def _abort_in_the_overlap_window() -> tuple[list[int], object, FinishReason]:
    worker = PausableSimWorker()
    engine = AsyncEngine(worker, SchedulerConfig(max_num_seqs=4), EngineOptions(plans_in_flight=2))
    engine.start()
    try:
        assert await engine.wait_available(10.0)
        stream = await engine.submit([5, 6, 7], None, SamplingParams(max_tokens=50, ignore_eos=True))
        tokens: list[int] = []
        while len(tokens) < 3:
            for chunk in await stream.next():
                tokens += chunk.token_ids
        worker.pause_sends()  # the next send is made after update(k), before k's tokens stream
        await asyncio.wait_for(worker.paused.wait(), 10.0)
        assert engine.abort(stream.request_id) == 1
        worker.gate.set()
        finish = usage = None
        while finish is None:
            for chunk in await asyncio.wait_for(stream.next(), 10.0):
                assert finish is None, "a chunk after the finish"
                tokens += chunk.token_ids
                finish, usage = chunk.finish_reason, chunk.usage
        assert engine.scheduler.kv.pool.num_free_blocks == engine.scheduler.kv.pool.num_blocks - 1
        return tokens, usage, finish
    finally:
        await engine.stop()


def test_abort_during_the_overlapped_send_streams_the_counted_tokens_first():
    tokens, usage, finish = asyncio.run(_abort_in_the_overlap_window())
    assert finish == FinishReason.ABORT
    assert usage.prompt_tokens == 3
    assert usage.completion_tokens == len(tokens)
    assert len(tokens) >= 4  # the held step's token reached the stream


async def _collect(stream) -> tuple[list[int], object, FinishReason]:
    tokens, finish, usage = [], None, None
    while finish is None:
        for chunk in await asyncio.wait_for(stream.next(), 10.0):
            assert finish is None, "a chunk after the finish"
            tokens += chunk.token_ids
            finish, usage = chunk.finish_reason, chunk.usage
    return tokens, usage, finish


async def _reuse_an_id_in_the_overlap_window():
    worker = PausableSimWorker()
    engine = AsyncEngine(worker, SchedulerConfig(max_num_seqs=4), EngineOptions(plans_in_flight=2))
    engine.start()
    try:
        assert await engine.wait_available(10.0)
        long = await engine.submit([1, 2], None, SamplingParams(max_tokens=40, ignore_eos=True))
        first = await engine.submit(
            [5, 6, 7], None, SamplingParams(max_tokens=4, ignore_eos=True), request_id="r"
        )
        # Pause the first send made after "r" was retired: its last outputs are held then.
        worker.pause_when = lambda: "r" not in engine.scheduler.requests
        await asyncio.wait_for(worker.paused.wait(), 10.0)
        second = await engine.submit(
            [9, 9], None, SamplingParams(max_tokens=3, ignore_eos=True), request_id="r"
        )
        worker.gate.set()
        results = [await _collect(s) for s in (first, second, long)]
        return results
    finally:
        await engine.stop()


def test_an_id_reused_while_its_last_outputs_are_held_gets_only_its_own_stream():
    (a_tokens, a_usage, a_finish), (b_tokens, b_usage, b_finish), _ = asyncio.run(
        _reuse_an_id_in_the_overlap_window()
    )
    assert (a_finish, len(a_tokens), a_usage.prompt_tokens, a_usage.completion_tokens) == (
        FinishReason.LENGTH,
        4,
        3,
        4,
    )
    assert (b_finish, len(b_tokens), b_usage.prompt_tokens, b_usage.completion_tokens) == (
        FinishReason.LENGTH,
        3,
        2,
        3,
    )
