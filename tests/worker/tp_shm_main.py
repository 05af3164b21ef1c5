"""One rank of tests/worker/test_tp_shm.py's groups, as its own process:
`python -m tests.worker.tp_shm_main RANK SIZE INIT_METHOD OUT SCENARIO`.

    exact   all-reduces and all-gathers of odd sizes and sizes past a slot, each rank checking
            its bits against the sum in rank order / the concatenation; whether the segment is
            still a file (must not be) and mapped (until close); gloo's threads (until close)
    hosts   every rank claims another host: the group must choose gloo, and still sum
    die     rank 1 exits just before the second all-reduce; rank 0 records the GroupBroken
    hang    rank 1 stops itself (SIGSTOP) there instead; rank 0 records the GroupBroken

Each rank saves what it saw (torch.save) to OUT.RANK.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import torch
import torch.distributed

from worker.tp import shm
from worker.tp.group import GroupBroken, TPGroup

# 1, odd, a slot's floats (shm.SLOT_BYTES / 4) exactly, and past two slots
SIZES = (1, 7, 1000, shm.SLOT_BYTES // 4, 2 * shm.SLOT_BYTES // 4 + 5)
# (rows, part, columns): a padded last part cut off; a part whose rows straddle the slots
GATHERS = ((1, 5, None), (3, 17, -3), (5, 100_003, -1))
STEP_TIMEOUT_S = {"hang": 1.0}  # the others: long, so only the pid check can end "die" quickly


def contribution(seed: int, rank: int, n: int) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed * 64 + rank))


def mapped_segments() -> list[str]:
    return [line for line in Path("/proc/self/maps").read_text().splitlines() if shm.PREFIX in line]


def exact(group: TPGroup, rank: int, size: int) -> dict:
    files = shm.SHM_DIR.glob(f"{shm.PREFIX}{os.getpid()}-*")  # rank 0's name; none on the others
    seen = {"transport": group.transport, "files": sorted(p.name for p in files)}
    sums_ok = []
    for n in SIZES:
        mine = contribution(n, rank, n)
        expected = contribution(n, 0, n)
        for r in range(1, size):  # rank order, the order the group promises
            expected = expected + contribution(n, r, n)
        group.all_reduce(mine)
        sums_ok.append(torch.equal(mine, expected))
    gathers_ok = []
    for rows, part, cut in GATHERS:
        columns = None if cut is None else size * part + cut
        parts = [contribution(part, r, rows * part).view(rows, part) for r in range(size)]
        expected = torch.cat(parts, dim=-1)[:, :columns]
        got = group.all_gather_last(parts[rank], columns)
        into = torch.full_like(expected, float("nan"))  # the forward's reused buffer
        gathers_ok.append(
            torch.equal(got, expected) and group.all_gather_last(parts[rank], columns, into) is into
        )
        gathers_ok.append(torch.equal(into, expected))
    seen |= {"sums_ok": sums_ok, "gathers_ok": gathers_ok, "mapped_before_close": len(mapped_segments())}
    seen["gloo_threads_before_close"] = len(gloo_threads())
    torch.distributed.barrier()
    group.close()
    seen["mapped_after_close"] = len(mapped_segments())
    seen["gloo_threads_after_close"] = len(gloo_threads())
    return seen


def broken(group: TPGroup, rank: int, scenario: str) -> dict:
    x = torch.ones(4)
    group.all_reduce(x)  # everyone alive once
    if rank == 1:
        if scenario == "die":
            os._exit(0)
        os.kill(os.getpid(), signal.SIGSTOP)  # the test kills it
    try:
        group.all_reduce(x)
    except GroupBroken as exc:
        return {"transport": group.transport, "error": str(exc)}
    return {"transport": group.transport, "error": None}


def gloo_threads() -> list[str]:
    """This process's threads that gloo started (their names: pt_gloo_runloop, gloo_tcp_loop)."""
    names = (Path(f"/proc/self/task/{t}/comm").read_text().strip() for t in os.listdir("/proc/self/task"))
    return [n for n in names if "gloo" in n]


def main(rank: int, size: int, init: str, out: str, scenario: str) -> int:
    torch.set_num_threads(1)
    if scenario == "hosts":
        shm.host_identity = lambda: f"host-{rank}"
    group = TPGroup(rank, size, init, torch.device("cpu"), step_timeout_s=STEP_TIMEOUT_S.get(scenario, 120.0))
    if scenario == "exact":
        seen = exact(group, rank, size)
    elif scenario == "hosts":
        x = torch.full((3,), float(rank + 1))
        group.all_reduce(x)
        seen = {"transport": group.transport, "sum": x.tolist()}
        torch.distributed.barrier()
        group.close()
    else:
        torch.save(broken(group, rank, scenario), f"{out}.{rank}")
        os._exit(0)  # a broken group: no orderly teardown (what worker/tp/rank.py does too)
    torch.save(seen, f"{out}.{rank}")
    return 0


if __name__ == "__main__":
    r, n, init, out, scenario = sys.argv[1:]
    sys.exit(main(int(r), int(n), init, out, scenario))
