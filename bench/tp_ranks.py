"""One rank of bench/tensor_parallel.py's groups, as its own process:
`python -m bench.tp_ranks RANK SIZE INIT_METHOD THREADS MODEL STEPS REPEATS OUT [BATCH...]`.

Rank 0 times decode steps at each BATCH (default 1 and 64) (bench.common.decode_step_seconds: scheduler-made
plans, only the worker's execute timed) and what the group's communication cost within them;
SIZE 1 is the single worker. The others follow until told to stop. A group of 2+ first times its
collectives alone, REPEATS times each, before any model is loaded (no compute to wait for), so
the same processes give both figures instead of a second group started for the collectives."""

from __future__ import annotations

import json
import sys
import time

import torch
import torch.distributed as dist

from bench.common import decode_step_seconds
from worker import Worker, WorkerConfig
from worker.tp.group import TPGroup
from worker.tp.rank import GroupLeader, follow, rank_worker

BATCHES = (1, 64)


def _config(model: str) -> WorkerConfig:
    return WorkerConfig(model=model, cpu_kernels="fast", num_blocks=1024)


def _time(worker, group, steps: int, batches) -> dict:
    figures = {}
    for batch in batches:
        before = None if group is None else (dict(group.seconds), dict(group.calls))
        started = time.perf_counter()
        figures[f"step_ms_b{batch}"] = 1e3 * decode_step_seconds(worker, batch, steps)
        if group is not None:  # per step of everything this call ran (prefills included)
            sends = group.calls["send"] - before[1]["send"]
            for kind in group.seconds:
                spent = group.seconds[kind] - before[0][kind]
                figures[f"{kind}_ms_per_step_b{batch}"] = 1e3 * spent / max(1, sends)
            figures[f"all_reduces_per_step_b{batch}"] = (
                group.calls["all_reduce"] - before[1]["all_reduce"]
            ) / max(1, sends)
        figures[f"wall_s_b{batch}"] = time.perf_counter() - started
    return figures


def _collective_latency(group: TPGroup, hidden: int, repeats: int) -> dict:
    """The all-reduce alone, both ranks ready (no compute to wait for): median microseconds
    for one decode row and for 64 (hidden 896: the 0.5B shape), and the all-gather of the
    0.5B shape's logits (vocab 151,936) for one row and for 64."""
    figures = {}
    for rows in BATCHES:
        x = torch.ones(rows, hidden)
        samples = []
        for _ in range(repeats):
            started = time.perf_counter()
            group.all_reduce(x)
            samples.append(time.perf_counter() - started)
        figures[f"all_reduce_us_{rows}x{hidden}"] = 1e6 * sorted(samples)[repeats // 2]
    for rows in BATCHES:
        logits, samples = torch.ones(rows, 151_936 // group.size), []
        out = torch.empty(rows, logits.shape[1] * group.size)  # reused, as the forward's (no page faults)
        for _ in range(max(3, repeats // rows)):
            started = time.perf_counter()
            group.all_gather_last(logits, out=out)
            samples.append(time.perf_counter() - started)
        figures[f"all_gather_us_{rows}x151936"] = 1e6 * sorted(samples)[len(samples) // 2]
    return figures


def main(
    rank: int, size: int, init: str, threads: int, model: str, steps: int, repeats: int, out: str, batches
) -> int:
    torch.set_num_threads(threads)
    if size == 1:
        figures = _time(Worker(_config(model)), None, steps, batches)
    else:
        group = TPGroup(rank, size, init, torch.device("cpu"), step_timeout_s=600.0)
        try:
            alone = _collective_latency(group, 896, repeats)  # before the model: their own cost
            worker = rank_worker(_config(model), group)
            if rank != 0:
                return follow(worker, group)
            leader = GroupLeader(worker, group)
            figures = {**alone, **_time(leader, group, steps, batches), "transport": group.transport}
            leader.stop()
        finally:
            # Every rank leaves together (none tears its connections down while a peer is still
            # in a collective); close() then joins gloo's threads before the interpreter ends.
            dist.barrier()
            group.close()
        if rank != 0:
            return 0
    with open(out, "w") as f:
        json.dump(figures, f)
    return 0


if __name__ == "__main__":
    r, n, init, threads, model, steps, repeats, out, *sizes = sys.argv[1:]
    batches = [int(b) for b in sizes] or BATCHES
    sys.exit(main(int(r), int(n), init, int(threads), model, int(steps), int(repeats), out, batches))
