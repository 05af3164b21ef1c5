"""Work for the real control plane (EngineCore) on a worker that may be one rank of a
tensor-parallel group (tests/worker/test_tensor_parallel_engine.py): the same job runs on one
worker (TP=1) in the test's process and on rank 0 of a TP=2 group (tests/worker/tp_engine_main.py),
and the two results must be equal. Each job says how every rank builds its worker (`settings`:
WorkerConfig fields) and how the engine drives it (`run`), checking invariants and leaks itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from base.plan import SamplingParams
from control_plane.engine import EngineCore
from control_plane.invariants import check_all_free
from control_plane.scheduler_config import SchedulerConfig


@dataclass(frozen=True)
class EngineJob:
    """Requests added at once, run to completion by EngineCore with invariants checked every step."""

    name: str
    settings: dict  # WorkerConfig fields
    requests: tuple[tuple[str, tuple[int, ...], SamplingParams], ...]
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    plans_in_flight: int = 1
    ends_sequences = True  # the worker mirrors no sequence afterwards (tp_engine_main checks every rank)

    def run(self, worker, max_steps: int = 5000) -> dict:
        """Every output in the order the engine handed it out (token ids, finish reason, beam
        score, cumulative logprob), each sample's tokens, and the scheduler's counters."""
        engine = EngineCore(
            worker, self.scheduler, check_invariants=True, plans_in_flight=self.plans_in_flight
        )
        for rid, prompt, sampling in self.requests:
            engine.add_request(rid, list(prompt), sampling)
        outputs, tokens = [], {}
        for _ in range(max_steps):
            if not engine.has_work():
                break
            for out in engine.step():
                reason = None if out.finish_reason is None else out.finish_reason.name
                outputs.append((out.request_id, out.index, tuple(out.new_token_ids), reason, out.beam_score,
                                out.cumulative_logprob))  # fmt: skip
                tokens.setdefault((out.request_id, out.index), []).extend(out.new_token_ids)
        else:
            raise AssertionError(f"{self.name}: requests unfinished after {max_steps} steps")
        check_all_free(engine.scheduler)
        assert worker.num_sequences == 0, "the worker still mirrors sequences the control plane ended"
        stats = engine.scheduler.stats()
        return {
            "outputs": outputs,
            "tokens": tokens,
            "preemptions": stats.num_preemptions,
            "spec_proposed": stats.spec_num_proposed,
            "spec_accepted": stats.spec_num_accepted,
        }


@dataclass(frozen=True)
class FuzzJob:
    """One run of the engine fuzz (tests/worker/test_engine_fuzz.py run_workload): invariants and
    the persistent block table every step, no block leaked, no sequence left on the worker."""

    name: str
    path: str
    workload: object  # test_engine_fuzz.Workload
    num_blocks: int
    in_flight: int
    spec: str = ""
    ends_sequences = True

    @property
    def settings(self) -> dict:
        from tests.worker.test_engine_fuzz import MAX_MODEL_LEN

        return dict(model=self.path, block_size=self.workload.block_size, num_blocks=self.num_blocks,
                    max_model_len=MAX_MODEL_LEN)  # fmt: skip

    def run(self, worker):
        from tests.worker.test_engine_fuzz import run_workload

        return run_workload(self.path, self.workload, self.num_blocks, self.in_flight, spec=self.spec,
                            worker=worker)  # fmt: skip


@dataclass(frozen=True)
class TeacherForcedJob:
    """The logits predicting each next token of `streams`, fed the streams (not the samples),
    all decoded one token per step in one batch (worker_test_utils.teacher_forced)."""

    name: str
    settings: dict
    streams: tuple[tuple[int, ...], ...]
    ends_sequences = False  # the driver never finishes its sequences

    def run(self, worker):
        from tests.worker.worker_test_utils import teacher_forced

        return teacher_forced(worker, [list(s) for s in self.streams])
