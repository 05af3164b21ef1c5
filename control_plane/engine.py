"""The synchronous, in-process engine: scheduler + a worker object in one loop.

Used by tests, benchmarks and the single-process demo; the gRPC control plane runs the same
schedule -> execute -> update cycle over a remote worker.
"""

from __future__ import annotations

import os
from typing import Protocol

from control_plane.invariants import check_plan, check_scheduler
from control_plane.plan import Plan, SamplingParams, StepResult, WorkerInfo
from control_plane.request import RequestOutput
from control_plane.scheduler import Scheduler
from control_plane.scheduler_config import SchedulerConfig


class WorkerLike(Protocol):
    def describe(self) -> WorkerInfo: ...

    def execute(self, plan: Plan) -> StepResult: ...

    def reset(self) -> None: ...


class EngineCore:
    def __init__(
        self, worker: WorkerLike, config: SchedulerConfig | None = None, check_invariants: bool | None = None
    ) -> None:
        self.worker = worker
        self.scheduler = Scheduler(config or SchedulerConfig(), worker.describe())
        if check_invariants is None:
            check_invariants = os.environ.get("PAGEDKV_CHECK_INVARIANTS", "") == "1"
        self.check_invariants = check_invariants

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingParams | None = None,
        priority: int = 0,
        cache_salt: str = "",
    ) -> None:
        self.scheduler.add_request(
            request_id, prompt_token_ids, sampling or SamplingParams(), priority, cache_salt
        )

    def step(self) -> list[RequestOutput]:
        sched = self.scheduler
        plan = sched.schedule()
        if self.check_invariants:
            check_plan(sched, plan)
            check_scheduler(sched)
        if plan.is_empty():
            return sched.update(plan, StepResult(plan.step_id))
        result = self.worker.execute(plan)
        outputs = sched.update(plan, result)
        if self.check_invariants:
            check_scheduler(sched)
        return outputs

    def run_to_completion(self, max_steps: int = 100_000) -> dict[tuple[str, int], list[int]]:
        """Step until every request ended; returns generated tokens per (request id, index)."""
        tokens: dict[tuple[str, int], list[int]] = {}
        self.finish_reasons: dict[tuple[str, int], object] = {}
        for _ in range(max_steps):
            if not self.scheduler.has_pending_work():
                return tokens
            for out in self.step():
                tokens.setdefault((out.request_id, out.index), []).extend(out.new_token_ids)
                if out.finish_reason is not None:
                    self.finish_reasons[(out.request_id, out.index)] = out.finish_reason
        raise RuntimeError(f"requests still unfinished after {max_steps} steps")
