"""Both services in the test process: an asyncio loop on a background thread hosts the worker
server and the control-plane server; tests talk to them through real channels with the
blocking `pagedkv.client.Client`, as a user would.

    test thread ── Client ──TCP (127.0.0.1:0)──▶ Engine server ─┐  loop thread
                                                   AsyncEngine ─┴─ unix socket ─▶ Worker server
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

from base import event_loop
from control_plane.engine_loop import AsyncEngine, EngineOptions
from control_plane.scheduler_config import SchedulerConfig
from control_plane.service import create_server, shutdown
from control_plane.worker_client import WorkerClient
from pagedkv.client import Client
from worker.service import WorkerServicer, create_worker_server

TIMEOUT_S = 120.0  # a hang guard only: CI machines are shared and may be very busy
# The loop the deployed processes run on (uvloop when installed), unless the run asks for
# another: PAGEDKV_TEST_EVENT_LOOP=asyncio runs these tests on the stdlib loop.
TEST_EVENT_LOOP = os.environ.get("PAGEDKV_TEST_EVENT_LOOP", "auto")


def run_async(coro):
    """`asyncio.run(coro)` on the loop the tests are asked to use (TEST_EVENT_LOOP)."""
    return event_loop.runner(TEST_EVENT_LOOP)(coro)


class Stack:
    def __init__(
        self,
        worker_factory: Callable[[], object],
        config: SchedulerConfig | None = None,
        options: EngineOptions | None = None,
        *,
        security=None,
        client_kwargs: dict | None = None,
    ) -> None:
        """`security`: the Engine server's base.security.ServerSecurity; `client_kwargs`: what
        `self.client` needs to pass it (tls_ca=..., auth_token=...)."""
        # A short private directory: Unix socket paths are limited to ~107 bytes.
        self._sockdir = tempfile.mkdtemp(prefix="pkv-")
        self.worker_address = f"unix://{self._sockdir}/worker.sock"
        self.worker_factory = worker_factory
        self.config = config or SchedulerConfig()
        self.options = options or EngineOptions(worker_grace_s=2.0)
        self.security = security
        self.loop = event_loop.new_loop(TEST_EVENT_LOOP)
        self._thread = threading.Thread(target=self.loop.run_forever, name="test-grpc-loop", daemon=True)
        self._thread.start()
        self.worker = None
        self.worker_server = None
        self.servicer = None
        self.address = self.call(self._start())
        self.client = Client(self.address, timeout=TIMEOUT_S, **(client_kwargs or {}))
        self.client.wait_ready(TIMEOUT_S)

    # -- running things on the loop thread ---------------------------------------------------
    def call(self, coro, timeout: float = TIMEOUT_S):
        fut: Future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return fut.result(timeout)
        except TimeoutError:
            raise TimeoutError(f"hung on the loop thread; its tasks:\n{self._task_stacks()}") from None

    def _task_stacks(self) -> str:
        """Where every task of the loop waits (a hang's diagnosis; read without locking)."""
        lines = []
        for task in list(asyncio.all_tasks(self.loop)):
            lines.append(f"{task.get_name()}: {task.get_coro()!r}")
            coro = task.get_coro()
            while coro is not None:  # the await chain, outermost first
                frame = getattr(coro, "cr_frame", None) or getattr(coro, "ag_frame", None)
                if frame is not None:
                    lines.append(f"  {frame.f_code.co_filename}:{frame.f_lineno} {frame.f_code.co_name}")
                else:
                    lines.append(f"  {coro!r}")
                coro = getattr(coro, "cr_await", None)
        return "\n".join(lines)

    def on_loop(self, fn: Callable[[], object]):
        """Run a plain function on the loop thread (engine state is only touched there)."""

        async def run():
            return fn()

        return self.call(run())

    async def _start(self) -> str:
        await self._start_worker()
        self.engine = AsyncEngine(WorkerClient(self.worker_address), self.config, self.options)
        self.server, address = await create_server("127.0.0.1:0", self.engine, security=self.security)
        return address

    async def _start_worker(self) -> None:
        self.worker = self.worker_factory()
        self.servicer = WorkerServicer(self.worker)
        self.worker_server, _ = await create_worker_server(self.worker_address, self.servicer)

    async def _stop_worker(self) -> None:
        await self.worker_server.stop(0)
        self.servicer.close()
        self.worker_server = None

    def kill_worker(self) -> None:
        self.call(self._stop_worker())

    def restart_worker(self) -> None:
        self.call(self._start_worker())

    # -- assertions helpers ------------------------------------------------------------------
    def wait_idle(self, timeout: float = TIMEOUT_S):
        """Poll GetStats until no request is live and every block is free; returns the stats."""
        deadline = time.monotonic() + timeout
        while True:
            s = self.client.stats()
            if s.num_live_requests == 0 and s.num_running == 0 and s.num_blocks_free == s.num_blocks_total:
                return s
            if time.monotonic() > deadline:
                raise AssertionError(f"engine not idle after {timeout}s: {s}")
            time.sleep(0.01)

    def close(self) -> None:
        self.client.close()

        async def stop():
            await shutdown(self.server, self.engine, grace=0.5)
            if self.worker_server is not None:
                await self._stop_worker()

        try:
            self.call(stop())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(5)
            self.loop.close()
            shutil.rmtree(self._sockdir, ignore_errors=True)


def in_thread(call: Callable[[], object]) -> tuple[threading.Thread, dict]:
    """Run a blocking client call beside the test: (started thread, box); once joined, the
    box holds "result", or "error" if the call raised ClientError."""
    from pagedkv.client import ClientError

    box: dict = {}

    def run() -> None:
        try:
            box["result"] = call()
        except ClientError as e:
            box["error"] = e

    thread = threading.Thread(target=run)
    thread.start()
    return thread, box
