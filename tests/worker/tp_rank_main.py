"""One rank of a tensor-parallel group for tests/worker/test_tensor_parallel.py, as its own
process: `python -m tests.worker.tp_rank_main RANK SIZE INIT_METHOD OUT KERNELS MODEL_DIR...`
(KERNELS: the --cpu-kernels of every rank, "reference" or "fast").

One group serves each model in turn (torch.distributed starts once per process). Rank 0
drives it with the hand-rolled PlanDriver (a chunked prefill beside whole ones, then decode;
greedy and sampled) and saves each model's logits and tokens to OUT; the others follow until told to stop.
"""

from __future__ import annotations

import sys

import torch

from base.plan import SamplingParams
from base.plan_codec import encode_plan
from tests.worker.worker_test_utils import PlanDriver
from worker import WorkerConfig
from worker.tp.group import EXECUTE, TPGroup
from worker.tp.rank import GroupLeader, follow, rank_worker

PROMPTS = [[3, 17, 42, 9, 88, 5, 61, 23, 7, 100, 11], [54, 2, 77, 31]]
DECODE_STEPS = 10
ECHO = 99  # a command kind no rank runs: the test's own


def config_for(model_dir: str, kernels: str = "reference") -> WorkerConfig:
    return WorkerConfig(model=model_dir, block_size=4, num_blocks=64, cpu_kernels=kernels)


class _Leading:
    """The driver's worker: each plan goes to the followers first (as GroupLeader.execute)."""

    def __init__(self, worker, group) -> None:
        self.worker, self.group = worker, group

    def describe(self):
        return self.worker.describe()

    def execute_with_logits(self, plan):
        self.group.send(EXECUTE, encode_plan(plan).SerializeToString())
        return self.worker.execute_with_logits(plan)


def drive(worker) -> dict:
    """Two greedy sequences (one prefilled in chunks) and one sampled from the worker's own
    generator (every rank draws the same: the same seed, the same gathered logits)."""
    driver = PlanDriver(worker)
    a, b = (driver.add(i + 1, p) for i, p in enumerate(PROMPTS))
    c = driver.add(3, PROMPTS[1], sampling=SamplingParams(temperature=1.0))
    driver.step({a.seq_id: 6, b.seq_id: None, c.seq_id: None})
    driver.step({a.seq_id: None, b.seq_id: None, c.seq_id: None})
    driver.decode([a.seq_id, b.seq_id, c.seq_id], DECODE_STEPS)
    return {
        "tokens": [a.generated, b.generated, c.generated],
        "logits": torch.cat([torch.stack(s.logits) for s in (a, b, c)]),
    }


def run_models(group, model_dirs: list[str], config_of, describe=lambda worker: {}) -> dict:
    """Each model in turn on one group: rank 0 drives it and returns its results per model
    dir (`drive`'s, and what `describe(worker)` adds); the others follow until told to stop."""
    results = {}
    for model_dir in model_dirs:
        worker = rank_worker(config_of(model_dir), group)
        if group.rank != 0:
            follow(worker, group)
            continue
        results[model_dir] = drive(_Leading(worker, group)) | describe(worker)
        GroupLeader(worker, group).stop()
    return results


def main(rank: int, size: int, init: str, out: str, kernels: str, model_dirs: list[str]) -> int:
    torch.set_num_threads(1)  # the cores split between ranks
    group = TPGroup(rank, size, init, torch.device("cpu"), step_timeout_s=120.0)
    results = run_models(group, model_dirs, lambda model_dir: config_for(model_dir, kernels))
    # A command larger than the first broadcast's inline room takes the second broadcast.
    big = bytes(range(256)) * 40  # 10,240 bytes
    if rank == 0:
        group.send(ECHO, big)
        torch.save(results, out)
    elif group.receive() != (ECHO, big):
        return 5
    group.close()
    return 0


if __name__ == "__main__":
    r, n, init, out, kernels, *models = sys.argv[1:]  # tests/worker/tp_launch.py's order
    sys.exit(main(int(r), int(n), init, out, kernels, models))
