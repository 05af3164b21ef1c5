"""The worker link of `AsyncEngine` (a mixin, like EngineRequests and EngineAdapters).

Worker connection (`_run`): connect (Describe, retried with back-off) -> Reset (drops mirrors
a previous control plane may have left) -> steps. A step that fails because the worker is
unreachable or restarted calls `Scheduler.on_worker_lost()` (every running sequence is
preempted for recompute, the prefix cache is dropped), new requests get UNAVAILABLE, and the
engine reconnects: within the restart wait -- `worker_grace_s`, or longer when the worker's last
start took longer (control_plane/restart_wait.py) -- the live requests simply continue
(recomputed on the new instance); after it they fail with UNAVAILABLE and the pool is back to
all-free. A step the worker *rejects* (INVALID_ARGUMENT: a control-plane bug) or fails (INTERNAL) ends
every live request with INTERNAL and resets the worker; the server stays up. While a step
overruns `step_liveness_s`, health is NOT_SERVING (`_watch_steps`).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

from base.logs import get_logger
from base.plan import WorkerInfo
from base.tokenizer import make_tokenizer
from control_plane.errors import EngineError, WorkerUnavailableError
from control_plane.grammar_check import GrammarCheck
from control_plane.restart_wait import restart_wait
from control_plane.scheduler import Scheduler
from control_plane.worker_client import WorkerOwnedError

log = get_logger("pagedkv.control")


class StepFailed(Exception):
    """The current step could not complete; carries the engine error to report."""

    def __init__(self, error: EngineError, lost: bool) -> None:
        self.error, self.lost = error, lost


def step_failure(error: EngineError) -> StepFailed:
    """Unreachable or restarted: lost (recompute on reconnect); refused or failed: not."""
    return StepFailed(error, lost=isinstance(error, WorkerUnavailableError))


class EngineConnection:
    """Mixin of `AsyncEngine`: `self.worker`, `self.options`, `self.scheduler`, `self.info`,
    `self._streams` and the loop's flags (`_connected`, `_stream_lost`, `_step_started`, ...)."""

    async def _connect(self) -> None:
        """Describe + Reset until both succeed, then (re)build the scheduler if needed."""
        delay, max_delay = self.options.reconnect_backoff_s
        attempt = 0
        while True:
            attempt += 1
            try:
                info = await self.worker.describe(timeout=self.options.describe_timeout_s)
                await self.worker.reset(timeout=self.options.describe_timeout_s)
                await self._sync_adapters()
                break
            except WorkerOwnedError as e:  # not transient: say so loudly, keep trying
                if attempt == 1 or attempt % 20 == 0:
                    log.error("worker.owned_by_another_control_plane", error=str(e), attempt=attempt)
            except EngineError as e:
                if attempt == 1 and isinstance(e, WorkerUnavailableError):
                    # Normal while a co-started worker starts: no error text; ~15 s of misses is not.
                    log.info("worker.waiting", worker=self.worker.target, status="waiting for worker")
                elif attempt == 1 or attempt % 20 == 0:
                    log.warning("worker.waiting", worker=self.worker.target, error=str(e), attempt=attempt)
            await asyncio.sleep(delay)
            delay = min(delay * 2, max_delay)
        self.worker.hold_lease(self._on_worker_stream_lost)
        self._attach(info)

    def _on_worker_stream_lost(self) -> None:
        """The worker's plan stream ended while no plan was in flight: it died or went away.
        Report it now (health NOT_SERVING, reconnect) rather than at the next request."""
        if self._connected and not self._stream_lost:
            self._stream_lost = True
            self._work.set()

    def _attach(self, info: WorkerInfo) -> None:
        old = self.info
        geometry_changed = old is None or _geometry(old) != _geometry(info)
        if geometry_changed:
            if self._streams:
                self._fail_all(WorkerUnavailableError("the worker restarted with a different model or pool"))
            self.scheduler = Scheduler(replace(self.config), info)
            self.tokenizer = make_tokenizer(info.tokenizer_kind, info.tokenizer_json, info.vocab_size)
            self.grammar_check = GrammarCheck(
                self.tokenizer, info.vocab_size, info.eos_token_ids, self.options.grammar_compile_timeout_s
            )
        self.info = info
        self._connected = True
        self._set_available(True)
        log.info(
            "worker.connected",
            worker=self.worker.target,
            instance_id=info.instance_id,
            model=info.model_name,
            num_blocks=info.num_blocks,
            block_size=info.block_size,
            kv_layout=info.kv_layout.name.lower(),
            max_model_len=self.scheduler.max_model_len,
            resumed_requests=len(self._streams),
        )
        self._work.set()

    async def _watch_steps(self) -> None:
        """Health goes NOT_SERVING while a step overruns `step_liveness_s` (the worker hangs,
        is stopped, or swaps): probes see it within a quarter of the bound."""
        bound = self.options.step_liveness_s
        while True:
            await asyncio.sleep(bound / 4)
            started = self._step_started
            if started is not None and not self._overrun and time.monotonic() - started > bound:
                self._overrun = True
                seconds = round(time.monotonic() - started, 1)
                log.warning("worker.step_overrun", seconds=seconds, bound_s=bound)
                self._set_available(False)

    async def _recover(self, failure: StepFailed) -> None:
        self.num_worker_losses += 1
        self._connected = False
        self._set_available(False)
        self.scheduler.on_worker_lost()
        if not failure.lost:
            log.error("worker.step_failed", error=str(failure.error), live_requests=len(self._streams))
            self._fail_all(failure.error)
            return  # _run reconnects: Describe + Reset, then continues with an empty engine
        opts = self.options
        start_s = self.info.start_seconds if self.info is not None else 0.0
        wait = restart_wait(opts.worker_grace_s, start_s, opts.worker_restart_wait_max_s)
        live = len(self._streams)
        log.warning(
            "worker.lost",
            error=str(failure.error),
            live_requests=live,
            **({"waiting_s": round(wait.seconds, 1), "because": wait.reason} if live else {}),
        )
        if self._streams and not await self._reconnect_within(wait.seconds):
            self._fail_all(failure.error)

    async def _reconnect_within(self, grace_s: float) -> bool:
        try:
            await asyncio.wait_for(self._connect(), grace_s)
        except asyncio.TimeoutError:
            return False
        return True


def _geometry(info: WorkerInfo) -> tuple:
    """Everything the scheduler was built from, except the instance id."""
    return (
        info.vocab_size,
        info.max_model_len,
        info.block_size,
        info.num_blocks,
        info.kv_layout,
        info.max_concurrent_seqs,
        info.eos_token_ids,
        info.tokenizer_kind,
        info.tokenizer_json,
    )
