"""Fixtures for the gRPC tests.

Most tests run the real servers, channels and engine loop against `ScriptedWorker`, the
torch-free SimWorker (which reads every context back through its block tables, so wrong
paging changes tokens) plus knobs to hold a step (`gate`), slow it down, or fail it. Tests
that need the real model use the module-scoped `real_stack`.
"""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest

from control_plane.engine_loop import EngineOptions
from control_plane.scheduler_config import SchedulerConfig
from control_plane.sim_worker import SimWorker
from tests.grpc.harness import Stack

VOCAB = 512  # >= 258 so the byte tokenizer fits
STEP_WAIT_S = 30.0  # SteppedWorker: a hang guard only


class ScriptedWorker(SimWorker):
    """SimWorker with a byte tokenizer (optional), a gate that holds Execute, a per-step delay
    and a one-shot failure. Execute runs on the worker server's thread, so blocking is fine."""

    def __init__(
        self, *, tokenizer: str = "byte", delay_s: float = 0.0, start_seconds: float = 0.0, **kw
    ) -> None:
        """`start_seconds`: what it reports as its start time (WorkerInfo.start_seconds)."""
        kw.setdefault("vocab_size", VOCAB)
        super().__init__(**kw)
        self._info = dataclasses.replace(self._info, tokenizer_kind=tokenizer, start_seconds=start_seconds)
        self.gate = threading.Event()
        self.gate.set()
        self.delay_s = delay_s
        self.fail_next: Exception | None = None
        self.num_executes = 0

    def execute(self, plan):
        if not self.gate.wait(20):
            raise TimeoutError("test gate never opened")
        if self.delay_s:
            time.sleep(self.delay_s)
        self.num_executes += 1
        if self.fail_next is not None:
            exc, self.fail_next = self.fail_next, None
            raise exc
        return super().execute(plan)


class SteppedWorker(ScriptedWorker):
    """Each Execute takes one permit from `permits` (a semaphore the test releases), so a test
    can stop the engine between two steps and look at its state."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.permits = threading.Semaphore(0)

    def execute(self, plan):
        if not self.permits.acquire(timeout=STEP_WAIT_S):
            raise TimeoutError("the test never released a step")
        return super().execute(plan)


@pytest.fixture
def stepped_stack():
    stack = Stack(lambda: SteppedWorker(num_blocks=64, block_size=16), SchedulerConfig())
    yield stack
    stack.worker.permits.release(1000)  # never leave the loop blocked in Execute
    stack.close()


@pytest.fixture
def make_stack():
    """make_stack(worker_kwargs, **scheduler config) -> a started Stack; closed after the test."""
    stacks = []

    def make(worker: dict | None = None, options: EngineOptions | None = None, **config) -> Stack:
        kw = {"num_blocks": 64, "block_size": 16, **(worker or {})}
        stack = Stack(lambda: ScriptedWorker(**kw), SchedulerConfig(**config), options)
        stacks.append(stack)
        return stack

    yield make
    for s in stacks:
        s.close()


@pytest.fixture
def stack(make_stack):
    return make_stack()


@pytest.fixture(scope="module")
def real_stack():
    """Both services around the real default-model worker (CPU), shared by a module."""
    from worker import Worker, WorkerConfig

    s = Stack(lambda: Worker(WorkerConfig(num_blocks=256)))
    yield s
    s.close()
