"""Both services in the benchmark process, as `pagedkv serve` wires them but in-process:
a background asyncio loop hosts the worker server (Unix socket) and the Engine server (TCP
loopback); clients use the real `pagedkv.client.AsyncClient` from the caller's own loop.

    bench loop ── AsyncClient ──TCP 127.0.0.1──▶ Engine server ─┐  server loop thread
                                                   AsyncEngine ─┴─ unix socket ─▶ Worker server
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import threading
from collections.abc import Callable
from concurrent.futures import Future

from control_plane.engine_loop import AsyncEngine, EngineOptions
from control_plane.scheduler_config import SchedulerConfig
from control_plane.service import create_server, shutdown
from control_plane.worker_client import WorkerClient
from pagedkv.client import Client
from worker.service import WorkerServicer, create_worker_server

START_TIMEOUT_S = 60.0


class ServingStack:
    def __init__(self, worker_factory: Callable[[], object], config: SchedulerConfig | None = None) -> None:
        self._sockdir = tempfile.mkdtemp(prefix="pkvb-")  # short: unix paths are limited to ~107 bytes
        self.worker_address = f"unix://{self._sockdir}/worker.sock"
        self.config = config or SchedulerConfig()
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="bench-servers", daemon=True)
        self._thread.start()
        self.worker = worker_factory()  # built here: model load happens before any timing
        self.address = self._call(self._start())
        with Client(self.address) as client:
            client.wait_ready(START_TIMEOUT_S)

    def _call(self, coro, timeout: float = START_TIMEOUT_S):
        fut: Future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        return fut.result(timeout)

    async def _start(self) -> str:
        self.servicer = WorkerServicer(self.worker)
        self.worker_server, _ = await create_worker_server(self.worker_address, self.servicer)
        self.engine = AsyncEngine(WorkerClient(self.worker_address), self.config, EngineOptions())
        self.server, address = await create_server("127.0.0.1:0", self.engine)
        return address

    def close(self) -> None:
        async def stop():
            await shutdown(self.server, self.engine, grace=0.5)
            await self.worker_server.stop(0)
            self.servicer.close()

        try:
            self._call(stop())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(5)
            self.loop.close()
            shutil.rmtree(self._sockdir, ignore_errors=True)

    def __enter__(self) -> ServingStack:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
