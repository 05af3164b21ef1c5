"""One rank of a tensor-parallel group running engine jobs (tests/worker/tp_engine_jobs.py), as
its own process: `python -m tests.worker.tp_engine_main RANK SIZE INIT_METHOD JOBS OUT`
(JOBS: a pickled list of jobs; OUT: rank 0's results, by job name).

For each job every rank builds the job's worker on its slices; rank 0 runs the job's engine
on it, sending each plan to the others first (as worker.tp.rank.GroupLeader does), and the
others follow. Every rank checks its persistent block table after every plan and that it
mirrors no sequence at the end, and hashes the outputs it sampled: the ranks must agree on
all of it (their samplers and mirrors stay identical without talking). A job that fails on
rank 0 is recorded (the followers are still told to stop, so no rank waits forever).
"""

from __future__ import annotations

import hashlib
import pickle
import sys
import time
import traceback

import torch

from base.plan_codec import encode_plan
from worker import WorkerConfig
from worker.tp.group import EXECUTE, TPGroup
from worker.tp.rank import GroupLeader, follow, rank_worker


class _Checked:
    """A rank's worker as the engine (rank 0) or follow() (the others) sees it: every plan runs,
    then the block table is checked and the sampled outputs hashed."""

    def __init__(self, worker, group: TPGroup | None) -> None:
        self._worker, self._group = worker, group
        self.digest, self.failures = hashlib.sha256(), []

    def __getattr__(self, name):
        return getattr(self._worker, name)

    def execute(self, plan):
        return self._run(plan, self._worker.execute)

    def execute_with_logits(self, plan):  # the PlanDriver's call (teacher-forced jobs)
        return self._run(plan, self._worker.execute_with_logits)

    def _run(self, plan, call):
        if self._group is not None:  # rank 0: the followers run it too
            self._group.send(EXECUTE, encode_plan(plan).SerializeToString())
        answer = call(plan)
        try:
            self._worker.mirrors.check_table()
        except AssertionError as exc:  # follow() would log and swallow it
            self.failures.append(f"step {plan.step_id}: {exc}")
        result = answer[0] if isinstance(answer, tuple) else answer
        self.digest.update(repr(result.outputs).encode())
        return answer

    def reset(self) -> None:
        self._worker.reset()


def main(rank: int, size: int, init: str, jobs_path: str, out: str) -> int:
    torch.set_num_threads(1)  # the cores split between ranks
    with open(jobs_path, "rb") as f:
        jobs = pickle.load(f)
    group = TPGroup(rank, size, init, torch.device("cpu"), step_timeout_s=120.0)
    results = {}
    for job in jobs:
        started = time.perf_counter()
        worker = rank_worker(WorkerConfig(**job.settings), group)
        built = time.perf_counter()
        checked = _Checked(worker, group if rank == 0 else None)
        if rank == 0:
            try:
                results[job.name] = {"result": job.run(checked)}
            except Exception:  # noqa: BLE001 -- reported to the test, after the followers stop
                results[job.name] = {"error": traceback.format_exc()}
            GroupLeader(worker, group).stop()
        else:
            follow(checked, group)
        if worker.num_sequences and job.ends_sequences:
            checked.failures.append(f"rank {rank} still mirrors {worker.num_sequences} sequences")
        seen = group.agree((checked.digest.hexdigest(), checked.failures))
        if rank == 0:
            results[job.name]["ranks"] = seen
            results[job.name]["seconds"] = (built - started, time.perf_counter() - built)
    if rank == 0:
        torch.save(results, out)
    group.close()
    return 0


if __name__ == "__main__":
    r, n, init, jobs_file, out_file = sys.argv[1:]  # tests/worker/tp_launch.py's order
    sys.exit(main(int(r), int(n), init, jobs_file, out_file))
