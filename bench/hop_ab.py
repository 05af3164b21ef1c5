"""The hop before and after a change (issue 32): served stacks from several checkouts, interleaved.

Each WAY is a checkout (and optional `pagedkv control` flags) whose `pagedkv worker` /
`pagedkv control` (or, with --paced-ms, `bench.paced_worker`) run as a ProcessStack from that
directory; the client is this process. Rounds rotate the order of the ways, so a burst of
background load lands on all of them alike. At 1 client, per way (medians over rounds):

    steps/s and its ratio to the ideal 1 / step   (--paced-ms: the overhead suite's paced figure)
    ITL p50 and served / direct                    (CPU worker: the overhead suite's itl_c1 ratio;
                                                    direct = EngineCore + Worker in this process)
    CPU us per step of the worker, the control plane and this client (/proc, utime + stime)

Run: `python -m bench.hop_ab [--paced-ms 0.5] [--rounds 6] before=/path/to/old/checkout
after=. after3=.:--plans-in-flight,3`. Each checkout needs `make setup` (generated protos).
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass

from bench.common import median
from bench.overhead import LevelRun, direct_runner, scheduler_config, served_runner
from bench.process_stack import ProcessStack

REQUESTS, MAX_TOKENS = 16, 128  # per round, at 1 client: long streams, few prefills


@dataclass(frozen=True)
class Way:
    name: str
    checkout: str
    control_args: tuple[str, ...]

    @classmethod
    def parse(cls, spec: str) -> Way:
        name, _, rest = spec.partition("=")
        checkout, _, flags = rest.partition(":")
        if not name or not checkout:
            raise ValueError(f"a way is NAME=CHECKOUT[:flag,value,...], got {spec!r}")
        return cls(name, os.path.abspath(checkout), tuple(f for f in flags.split(",") if f))


def _cpu_s(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _own_cpu_s() -> float:
    t = os.times()
    return t.user + t.system


def _measured(stack: ProcessStack, round_no: int, paced_ms: float | None) -> dict:
    pids = stack.pids
    before = [_cpu_s(p) for p in pids] + [_own_cpu_s()]
    run: LevelRun = served_runner(stack)(1, REQUESTS, MAX_TOKENS, round_no)
    after = [_cpu_s(p) for p in pids] + [_own_cpu_s()]
    steps = run.tokens  # one token per step at 1 client
    worker, control, client = ((b - a) / steps * 1e6 for a, b in zip(before, after, strict=True))
    res = {"itl_ms": run.itl_p50() * 1e3, "worker_us": worker, "control_us": control, "client_us": client}
    res["steps_per_s"] = run.steps_per_s()
    if paced_ms is not None:
        res["ideal_ratio"] = res["steps_per_s"] * paced_ms / 1e3
    return res


def compare(ways: list[Way], rounds: int, paced_ms: float | None, worker_args: tuple[str, ...] = ()) -> dict:
    """`worker_args`: `pagedkv worker` flags of every way's CPU worker and of the direct one
    (--model, --dtype: the step the hop is compared with)."""
    config = scheduler_config()
    worker_command = None
    if paced_ms is not None:
        worker_command = [sys.executable, "-m", "bench.paced_worker", "--step-ms", f"{paced_ms:g}"]
    stacks = {}
    try:
        for way in ways:
            stacks[way.name] = ProcessStack(
                config,
                worker_args=worker_args,
                control_args=way.control_args,
                worker_command=worker_command,
                cwd=way.checkout,
            )
        direct = None
        if paced_ms is None:
            from control_plane.engine import EngineCore
            from worker import Worker, WorkerConfig

            direct = direct_runner(EngineCore(Worker(_direct_config(WorkerConfig, worker_args)), config))
        rows: dict[str, list[dict]] = {w.name: [] for w in ways}
        for r in range(rounds):
            direct_itl = direct(1, REQUESTS, MAX_TOKENS, r).itl_p50() * 1e3 if direct else None
            order = ways[r % len(ways) :] + ways[: r % len(ways)]
            for way in order:
                row = _measured(stacks[way.name], r, paced_ms)
                if direct_itl is not None:
                    row["direct_itl_ms"], row["itl_ratio"] = direct_itl, row["itl_ms"] / direct_itl
                rows[way.name].append(row)
                figures = ", ".join(f"{k} {v:.3f}" for k, v in row.items())
                print(f"round {r} {way.name}: {figures}", flush=True)
    finally:
        for stack in stacks.values():
            stack.close()
    return {name: {k: round(median([row[k] for row in rs]), 3) for k in rs[0]} for name, rs in rows.items()}


def _direct_config(config_class, worker_args: tuple[str, ...]):
    """The in-process worker's config from the served one's --model / --dtype flags."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--model")
    ap.add_argument("--dtype")
    flags, rest = ap.parse_known_args(list(worker_args))
    if rest:
        raise SystemExit(f"--worker-args: only --model and --dtype reach the direct worker, not {rest}")
    return config_class(model=flags.model, dtype=flags.dtype)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("ways", nargs="+", help="NAME=CHECKOUT[:control,flags,...]")
    ap.add_argument("--paced-ms", type=float, help="a paced worker of this step time, not the CPU worker")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--worker-args", default="", help="worker flags, comma-separated: --model,random:...")
    args = ap.parse_args()
    worker_args = tuple(a for a in args.worker_args.split(",") if a)
    result = compare([Way.parse(s) for s in args.ways], args.rounds, args.paced_ms, worker_args)
    print(f"medians over {args.rounds} rounds, load average {os.getloadavg()}:")
    for name, figures in result.items():
        print(f"  {name}: {figures}")


if __name__ == "__main__":
    main()
