"""Start-up log lines while the control plane looks for its worker: the first miss (a
co-started worker still loading, as under `pagedkv serve`) is an info line without an error
text; misses that go on, and errors other than "unreachable", are warnings that say why."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading

import grpc
from structlog.testing import capture_logs

from control_plane.engine_loop import AsyncEngine, EngineOptions
from control_plane.errors import EngineError, WorkerUnavailableError
from control_plane.scheduler_config import SchedulerConfig
from control_plane.worker_client import WorkerStepError

TIMEOUT_S = 120  # a hang guard only


def test_first_miss_of_a_worker_still_starting_is_logged_without_an_error(tmp_path):
    """`pagedkv control` pointed at a socket nobody listens on yet: its first line about the
    worker says it is waiting, at info level, with no error text."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "pagedkv.cli", "control", "--worker", f"unix://{tmp_path}/worker.sock"]
        + ["--listen", "127.0.0.1:0", "--log-format", "json", "--log-level", "debug"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    guard = threading.Timer(TIMEOUT_S, proc.kill)
    guard.start()
    try:
        waiting = None
        for line in proc.stderr:
            entry = json.loads(line)
            if entry["event"].startswith("worker."):
                waiting = entry
                break
    finally:
        guard.cancel()
        proc.terminate()
        proc.wait(TIMEOUT_S)
    assert waiting is not None, "the control plane never logged about its worker"
    assert waiting["event"] == "worker.waiting" and waiting["level"] == "info"
    assert waiting["status"] == "waiting for worker"
    assert "error" not in waiting


class _FailingWorker:
    """A worker client whose Describe always fails with `error`."""

    target = "unix:///nowhere/worker.sock"

    def __init__(self, error: EngineError) -> None:
        self.error = error
        self.calls = 0

    async def describe(self, timeout=None):
        self.calls += 1
        raise self.error

    async def close(self) -> None:
        pass


def _misses(error: EngineError, attempts: int) -> list[dict]:
    """The engine's log entries while `attempts` Describe calls fail with `error`."""
    worker = _FailingWorker(error)

    async def run() -> None:
        engine = AsyncEngine(worker, SchedulerConfig(), EngineOptions(reconnect_backoff_s=(0.0, 0.0)))
        engine.start()
        while worker.calls < attempts:
            await asyncio.sleep(0.001)
        await engine.stop()

    with capture_logs() as logs:
        asyncio.run(asyncio.wait_for(run(), TIMEOUT_S))
    return [e for e in logs if e["event"] == "worker.waiting"]


def test_misses_that_go_on_become_a_warning_with_the_error():
    entries = _misses(WorkerUnavailableError("worker at unix:///nowhere unreachable"), attempts=21)
    warnings = [e for e in entries if e["log_level"] == "warning"]
    assert warnings and warnings[0]["attempt"] == 20
    assert warnings[0]["error"] == "worker at unix:///nowhere unreachable"


def test_a_first_error_other_than_unreachable_is_a_warning_with_the_error():
    error = WorkerStepError("Describe failed: INTERNAL boom", grpc.StatusCode.INTERNAL)
    (first, *_) = _misses(error, attempts=2)
    assert first["log_level"] == "warning" and first["attempt"] == 1
    assert first["error"] == str(error)
