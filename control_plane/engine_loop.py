"""The control plane's asyncio engine: one task runs every step for every live request.

    Generate handlers ──submit()──▶ Scheduler ◀──┐
    Abort / cancel   ──abort()───▶    │         │ update(plan, result)
                                   schedule()   │
                                      ▼         │
                                    Plan ──worker.send() ... worker.receive()──▶ StepResult
                                                                       │
                    RequestStream queues ◀── text, stop strings ◀──────┘

Overlap scheduling (the default): the loop keeps `EngineOptions.plans_in_flight` (default 2)
plans in flight. When result k arrives it runs `update(k)`, then
plans and sends step k+2 -- the worker is busy with k+1 meanwhile -- and only then streams
step k's tokens (text, stop strings). A decode whose last token is still on its way is
planned with `feed_last_sample` (base.plan); stops are therefore found one step late
and the extra token is dropped in `update` (control_plane.scheduler_update). 3 in flight
hides a transport round trip longer than a step (`--plans-in-flight 3`, for steps shorter
than ~1 ms: docs/ARCHITECTURE.md). 1 in flight (`--no-overlap`) streams before planning: the
strict loop, for comparison and debugging.

Concurrency model: a single event loop thread. Only the loop task calls `schedule`, `update`
and `on_worker_lost`; handlers call `add_request` / `abort_request` at await points, i.e.
possibly while a plan is in flight. The scheduler allows that: an aborted sequence's blocks
are freed at once, `update` skips its outputs, and the next plan tells the worker to drop its
mirror -- so an abort frees blocks within one step. When nothing is pending the loop waits on
an event (no polling).

The worker link (connect, attach, recover after a loss): control_plane/engine_connection.py.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from base.logs import get_logger
from base.plan import AdapterInfo, Plan, StepResult, WorkerInfo
from base.tokenizer import Tokenizer
from control_plane.adapters import AdapterTable
from control_plane.engine_adapters import EngineAdapters
from control_plane.engine_connection import EngineConnection, StepFailed, step_failure
from control_plane.engine_requests import EngineRequests
from control_plane.errors import (
    EngineError,
    RequestNotFoundError,
    WorkerUnavailableError,
)
from control_plane.grammar_check import GrammarCheck
from control_plane.images import ImageSizeCache
from control_plane.request import FinishReason, RequestOutput
from control_plane.request_stream import RequestStream, TokenTimings
from control_plane.scheduler import Scheduler
from control_plane.scheduler_config import SchedulerConfig
from control_plane.stats import SequenceTable, StatsSnapshot

log = get_logger("pagedkv.control")


class AsyncWorker(Protocol):
    target: str

    async def describe(self, timeout: float | None = None) -> WorkerInfo: ...

    async def send(self, plan: Plan, expected_instance_id: str = "") -> None: ...

    async def receive(self) -> StepResult: ...

    async def reset(self, timeout: float | None = None) -> str: ...

    def hold_lease(self, on_lost: Callable[[], None]) -> None: ...

    async def close(self) -> None: ...

    async def load_adapter(self, name: str, path: str) -> AdapterInfo: ...

    async def drop_adapter(self, adapter_id: str) -> None: ...

    async def list_adapters(self) -> list[AdapterInfo]: ...


class EngineObserver(Protocol):
    """Receives the latencies the engine measures (base.metrics turns them into
    histograms). Called on the event loop thread; must not block."""

    def on_step(self, seconds: float) -> None: ...

    def on_tokens(self, timings: TokenTimings) -> None: ...


@dataclass(slots=True)
class EngineOptions:
    # How long live requests wait for a lost worker to return: at least this, longer when the
    # worker's last start took longer (control_plane/restart_wait.py), at most the cap below.
    worker_grace_s: float = 5.0
    worker_restart_wait_max_s: float = 300.0
    reconnect_backoff_s: tuple[float, float] = (0.05, 1.0)  # first and largest retry delay
    describe_timeout_s: float = 5.0
    # A step in flight longer than this turns health NOT_SERVING (and refuses new requests)
    # until it completes: a wedged worker is visible to probes long before the step timeout.
    step_liveness_s: float = 30.0
    # Plans sent ahead of the result awaited: 1 = the strict loop, >= 2 = overlap scheduling
    # (plan step k+1 while step k runs); see the module docstring.
    plans_in_flight: int = 2
    # Structured outputs: a schema / regex / grammar that does not compile within this many
    # seconds is refused (control_plane/grammar_check.py).
    grammar_compile_timeout_s: float = 10.0


class AsyncEngine(EngineRequests, EngineAdapters, EngineConnection):
    def __init__(
        self,
        worker: AsyncWorker,
        config: SchedulerConfig | None = None,
        options: EngineOptions | None = None,
    ) -> None:
        self.config = config or SchedulerConfig()
        self.config.validate()
        self.options = options or EngineOptions()
        self.worker = worker
        self.scheduler: Scheduler | None = None
        self.info: WorkerInfo | None = None
        self.tokenizer: Tokenizer | None = None
        self.grammar_check: GrammarCheck | None = None
        self.image_sizes = ImageSizeCache()  # images already decoded (by content hash)
        self.available = False
        self._listeners: list[Callable[[bool], None]] = []
        self._connected = False  # a worker answered Describe + Reset and no step failed since
        self._draining = False
        self._streams: dict[int, RequestStream] = {}  # by Request.arrival (ids are reused)
        self._work = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._watchdog: asyncio.Task | None = None
        self._step_started: float | None = None  # monotonic start of the step in flight
        self._overrun = False  # that step has run past options.step_liveness_s
        self._stream_lost = False  # the worker's plan stream ended between steps
        self._stopping = False
        self.num_worker_losses = 0
        self.num_generation_tokens = 0  # tokens sampled for clients since start (all samples)
        self._observer: EngineObserver | None = None
        # Outputs of the last update not yet streamed (overlap: while the next plan is sent).
        self._held_outputs: list[RequestOutput] = []
        self.adapters = AdapterTable()  # LoRA adapters by name (control_plane/adapters.py)

    # -- lifecycle --------------------------------------------------------------------------
    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="pagedkv-engine-loop")
            self._watchdog = asyncio.create_task(self._watch_steps(), name="pagedkv-step-watchdog")

    async def stop(self) -> None:
        """Fail every live stream with UNAVAILABLE, stop the loop, close the worker channel."""
        self._set_available(False)
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        if self._task is not None:
            # Cancel until it ends: Python 3.11's asyncio.wait_for can swallow a cancellation
            # that races with its inner await finishing, and the loop then idled forever (a
            # shutdown hang seen in full test runs). `_stopping` makes the loop exit as well.
            self._stopping = True
            task = self._task
            while not task.done():
                task.cancel()
                await asyncio.wait({task}, timeout=0.1)
            self._task = None
        self._fail_all(WorkerUnavailableError("the server is shutting down; retry on another replica"))
        await self.worker.close()

    async def wait_available(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while not self.available and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        return self.available

    def add_availability_listener(self, listener: Callable[[bool], None]) -> None:
        """Called with True when a worker connects and False when it is lost or we drain."""
        self._listeners.append(listener)

    def set_observer(self, observer: EngineObserver | None) -> None:
        """Report step durations and token latencies to `observer` (one at a time)."""
        self._observer = observer

    def drain(self) -> None:
        """Refuse new requests from now on (UNAVAILABLE); live ones keep running."""
        self._draining = True
        self._set_available(False)

    def _set_available(self, ok: bool) -> None:
        ok = ok and not self._draining and not self._overrun
        if ok != self.available:
            self.available = ok
            for listener in self._listeners:
                listener(ok)

    # -- queries ----------------------------------------------------------------------------
    def stats(self) -> StatsSnapshot | None:
        return self.scheduler.stats() if self.scheduler is not None else None

    def block_tables(self, request_id: str) -> list[SequenceTable]:
        if self.scheduler is None:
            raise RequestNotFoundError(f"no live request with id {request_id!r}")
        return self.scheduler.block_tables(request_id)

    @property
    def num_live_requests(self) -> int:
        return len(self._streams)

    # -- the loop ---------------------------------------------------------------------------
    async def _run(self) -> None:
        while not self._stopping:
            if not self._connected:
                await self._connect()
            try:
                await self._steps()
            except StepFailed as failure:
                await self._recover(failure)

    async def _steps(self) -> None:
        sched = self.scheduler
        depth = self.options.plans_in_flight
        overlap = depth > 1
        in_flight: deque[tuple[Plan, float]] = deque()  # (plan, sent at): lost with any failure
        last_result_at = 0.0
        while not self._stopping:
            if self._stream_lost and not in_flight:
                self._stream_lost = False
                lost = WorkerUnavailableError(f"worker at {self.worker.target} closed its plan stream")
                raise StepFailed(lost, lost=True)
            await self._plan_ahead(in_flight, depth)
            if not in_flight:
                await self._drop_retired_adapters()  # e.g. an abort ended an unloaded adapter's last request
                await self._wait_for_work(sched.has_pending_work())
                continue
            plan, sent_at = in_flight.popleft()
            result = await self._receive(bool(in_flight))
            if self._observer is not None:
                now = time.perf_counter()
                self._observer.on_step(now - max(sent_at, last_result_at))
                last_result_at = now
            # Held, not local: an abort while step k+2 is sent must stream these tokens
            # before its finish, because the finish's usage counts them (_dispatch).
            self._held_outputs = sched.update(plan, result)
            await self._drop_retired_adapters()
            try:
                if overlap:  # the worker gets step k+2 before step k's tokens are streamed
                    await self._plan_ahead(in_flight, depth)
            finally:  # even if that send failed: these tokens are in the sequences already
                self._dispatch([])

    async def _plan_ahead(self, in_flight: deque[tuple[Plan, float]], depth: int) -> None:
        """Schedule and send plans until `depth` are in flight or nothing is runnable."""
        sched = self.scheduler
        while len(in_flight) < depth and sched.has_pending_work() and not self._stopping:
            plan = sched.schedule()
            if plan.is_empty():  # nothing runnable now; outputs of sequences ended while planning
                self._dispatch(sched.update(plan, StepResult(plan.step_id)))
                return
            if not in_flight:
                self._step_started = time.monotonic()
            sent_at = time.perf_counter()
            try:
                await self.worker.send(plan, self.info.instance_id)
            except EngineError as e:
                self._end_step()
                raise step_failure(e) from None
            in_flight.append((plan, sent_at))

    async def _receive(self, more_in_flight: bool) -> StepResult:
        try:
            return await self.worker.receive()
        except EngineError as e:
            raise step_failure(e) from None
        finally:
            self._end_step()
            if more_in_flight:  # the next plan's liveness clock starts as this one ends
                self._step_started = time.monotonic()

    async def _wait_for_work(self, pending: bool) -> None:
        """Nothing in flight: wait for an add/abort. If requests wait although nothing was
        runnable (rare: a head-of-line request the pool cannot take yet), wait 50 ms at most."""
        self._work.clear()
        if not pending:
            await self._work.wait()
            return
        try:
            await asyncio.wait_for(self._work.wait(), 0.05)
        except asyncio.TimeoutError:
            pass

    def _end_step(self) -> None:
        self._step_started = None
        if self._overrun:
            self._overrun = False
            log.info("worker.step_recovered")
            self._set_available(self._connected)

    def _fail_all(self, error: EngineError) -> None:
        """End every live request with `error` and free its blocks (state stays consistent)."""
        if self.scheduler is not None:
            self.scheduler.abort_all(FinishReason.ERROR)
        streams, self._streams = self._streams, {}
        for stream in streams.values():
            stream.fail(error)
        if streams:
            log.warning("requests.failed", count=len(streams), error=str(error))
