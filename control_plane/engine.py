"""The synchronous, in-process engine: scheduler + a worker object in one loop.

Used by tests, benchmarks and the single-process demo; the gRPC control plane runs the same
schedule -> execute -> update cycle over a remote worker.

`plans_in_flight > 1` replays the served engine's overlap order of calls with a synchronous
worker: that many plans are scheduled and executed before the oldest one's result is applied
(the worker's own order is unchanged), so a differential test can compare both loops on one
scheduler.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Sequence
from typing import Protocol

from base.plan import AdapterInfo, Plan, SamplingParams, StepResult, WorkerInfo
from control_plane.adapters import AdapterTable, check_adapter_name
from control_plane.images import ImageSizeCache, expand_images
from control_plane.invariants import check_plan, check_scheduler
from control_plane.request import RequestOutput
from control_plane.scheduler import Scheduler
from control_plane.scheduler_config import SchedulerConfig


class WorkerLike(Protocol):
    def describe(self) -> WorkerInfo: ...

    def execute(self, plan: Plan) -> StepResult: ...

    def reset(self) -> None: ...


class EngineCore:
    def __init__(
        self,
        worker: WorkerLike,
        config: SchedulerConfig | None = None,
        check_invariants: bool | None = None,
        *,
        plans_in_flight: int = 1,
    ) -> None:
        self.worker = worker
        self.plans_in_flight = plans_in_flight  # 1 = the strict loop
        self._in_flight: deque[tuple[Plan, StepResult]] = deque()  # executed, not applied
        self.scheduler = Scheduler(config or SchedulerConfig(), worker.describe())
        self.image_sizes = ImageSizeCache()  # images already decoded (by content hash)
        self.adapters = AdapterTable()
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
        images: Sequence[bytes] = (),
        adapter: str = "",
    ) -> None:
        """`images`: encoded files, one per image placeholder of the prompt (expanded here).
        `adapter`: a loaded LoRA adapter's name ("" = the base model)."""
        adapter_id = self.adapters.resolve(adapter)
        prompt_images = None
        if images or self.scheduler.info.accepts_images:
            prompt_token_ids, prompt_images = expand_images(
                list(prompt_token_ids), images, self.scheduler.info, self.image_sizes
            )
        self.scheduler.add_request(
            request_id,
            prompt_token_ids,
            sampling or SamplingParams(),
            priority,
            cache_salt,
            prompt_images,
            adapter_id,
        )

    def load_adapter(self, name: str, path: str) -> AdapterInfo:
        """Load a LoRA adapter on the worker under `name` (see control_plane/adapters.py)."""
        check_adapter_name(name)
        info = self.worker.load_adapter(name, path)
        self.adapters.register(info)
        self._drop_retired()
        return info

    def unload_adapter(self, name: str) -> None:
        self.adapters.unregister(name)
        self._drop_retired()

    def abort_request(self, request_id: str) -> list[RequestOutput]:
        """Abort a live request (Scheduler.abort_request); an adapter retired meanwhile whose
        last request this was is dropped on the worker at once."""
        outputs = self.scheduler.abort_request(request_id)
        self._drop_retired()
        return outputs

    def _drop_retired(self) -> None:
        if self.adapters.retired:
            live = (r.adapter for r in self.scheduler.requests.values())
            for info in self.adapters.droppable(live):
                self.worker.unload_adapter(info.adapter_id)

    def step(self) -> list[RequestOutput]:
        """One step: schedule and execute a plan, and apply a result (with overlap: the
        oldest in flight's). Outputs of the result applied."""
        sched = self.scheduler
        in_flight = self._in_flight
        if in_flight and not sched.has_pending_work():
            return self._apply(*in_flight.popleft())  # drain: nothing left to plan
        plan = sched.schedule()
        if self.check_invariants:
            check_plan(sched, plan)
            check_scheduler(sched)
        result = StepResult(plan.step_id) if plan.is_empty() else self.worker.execute(plan)
        in_flight.append((plan, result))
        return self._apply(*in_flight.popleft()) if len(in_flight) >= self.plans_in_flight else []

    def _apply(self, plan: Plan, result: StepResult) -> list[RequestOutput]:
        outputs = self.scheduler.update(plan, result)
        self._drop_retired()
        if self.check_invariants:
            check_scheduler(self.scheduler)
        return outputs

    def has_work(self) -> bool:
        return self.scheduler.has_pending_work() or bool(self._in_flight)

    def run_to_completion(self, max_steps: int = 100_000) -> dict[tuple[str, int], list[int]]:
        """Step until every request ended; returns generated tokens per (request id, index)."""
        tokens: dict[tuple[str, int], list[int]] = {}
        self.finish_reasons: dict[tuple[str, int], object] = {}
        for _ in range(max_steps):
            if not self.has_work():
                return tokens
            for out in self.step():
                tokens.setdefault((out.request_id, out.index), []).extend(out.new_token_ids)
                if out.finish_reason is not None:
                    self.finish_reasons[(out.request_id, out.index)] = out.finish_reason
        raise RuntimeError(f"requests still unfinished after {max_steps} steps")
