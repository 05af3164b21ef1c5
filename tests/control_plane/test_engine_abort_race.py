"""An Abort that lands while the overlapped loop sends the next plan (the window in which the
last step's tokens are appended to the sequences but not yet streamed) must not let the
finish overtake those tokens: the finish's usage counts them. A 16-client soak found this
("usage says 6 tokens, received 5"); here the window is held open on purpose.

The worker is a SimWorker behind an in-process AsyncWorker whose `send` can be paused.
"""

from __future__ import annotations

import asyncio
from collections import deque

from control_plane.engine_loop import AsyncEngine, EngineOptions
from control_plane.plan import Plan, SamplingParams, StepResult
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

    async def send(self, plan: Plan, expected_instance_id: str = "") -> None:
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
