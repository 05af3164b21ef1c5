"""Tensor parallelism on this host's CPU (issue 40): TP=2 (one thread per rank, gloo) against
TP=1 (one worker, the same threads in all), decode step times at batch 1 and 64 on the
qwen3-small-fp32 preset (8 layers, hidden 512, 8 heads / 4 KV heads, vocab 32000), both on the
fused CPU kernels (TP ranks drive them op by op, worker/tp/cpu_forward.py; one worker runs the
whole stack in one C call). Also what the group's communication costs per step:
rank 0's plan broadcast, the all-reduces (two per layer + the embedding) and the logits'
all-gather. A correctness-first figure on 2 cores: splitting 2 cores between 2 processes buys
no compute, so the ratio shows the price of the collectives, not a speed-up.

TP=2 runs twice, on each transport of the forward's collectives: "tp2" chooses as a served
group does (shared memory on one host, worker/tp/shm.py; `tp2_transport` says what ran),
"tp2_gloo" is forced onto gloo (PAGEDKV_TP_TRANSPORT=gloo).

Runs alternate TP=1 / TP=2 / TP=2 on gloo in separate processes (each group owns the cores while it runs).
Each TP=2 group times its collectives alone (both ranks ready, no compute) before it loads the
model: the `*_all_reduce_us_*` / `*_all_gather_us_*` figures, medians over the rounds.
Run: `python -m bench.tensor_parallel [--quick]` (another model: PAGEDKV_TP_BENCH_MODEL).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.common import median
from bench.suite_cli import suite_main
from worker.tp.shm import TRANSPORT_ENV

# PAGEDKV_TP_BENCH_MODEL=random:qwen2.5-0.5b: the 0.5B shape (bf16 weights, ~10x the step).
MODEL = os.environ.get("PAGEDKV_TP_BENCH_MODEL", "random:qwen3-small-fp32")
BATCHES = (1, 64)
RANK_TIMEOUT_S = 900


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _group(size: int, threads: int, transport: str, steps: int, repeats: int, batches=BATCHES) -> dict:
    init = f"tcp://127.0.0.1:{_free_port()}"
    env = {**os.environ, TRANSPORT_ENV: transport}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "figures.json"
        cmd = [sys.executable, "-m", "bench.tp_ranks"]
        args = [str(size), init, str(threads), MODEL, str(steps), str(repeats), str(out), *map(str, batches)]
        procs = [subprocess.Popen([*cmd, str(rank), *args], env=env) for rank in range(size)]
        codes = [p.wait(RANK_TIMEOUT_S) for p in procs]
        if codes != [0] * size:
            raise RuntimeError(f"TP={size} ranks exited with {codes}")
        return json.loads(out.read_text())


def run(quick: bool = False) -> dict:
    steps, rounds, batches = (3, 1, (1,)) if quick else (12, 2, BATCHES)
    repeats = 50 if quick else 400  # each collective, timed alone in every TP=2 group
    cores = max(2, len(os.sched_getaffinity(0)))
    # TP=1 twice: with every core (what one worker gets) and with one thread (a rank's share)
    plan = {"tp1": (1, cores, "auto"), "tp1_1thread": (1, 1, "auto"), "tp2": (2, cores // 2, "auto"),
            "tp2_gloo": (2, cores // 2, "gloo")}  # fmt: skip
    if quick:  # the CI smoke run: one baseline, the rank's share of the cores
        del plan["tp1"]
    runs: dict[str, list[dict]] = {name: [] for name in plan}
    for r in range(rounds):
        for name in plan if r % 2 == 0 else reversed(plan):
            runs[name].append(_group(*plan[name], steps, repeats, batches=batches))
    figures = {"model": MODEL, "cores": cores, "load_avg_start": os.getloadavg()[0]}
    for tp2 in ("tp2", "tp2_gloo"):
        for key in runs[tp2][0]:
            if not key.startswith("wall"):
                pick = (lambda v: v[0]) if key == "transport" else median
                figures[f"{tp2}_{key}"] = pick([run[key] for run in runs[tp2]])
    for batch in batches:
        for name in (n for n in runs if n.startswith("tp1")):
            figures[f"{name}_step_ms_b{batch}"] = median([run[f"step_ms_b{batch}"] for run in runs[name]])
        for tp2 in ("tp2", "tp2_gloo"):
            for name in (n for n in runs if n.startswith("tp1")):
                figures[f"{tp2}_over_{name}_b{batch}"] = (
                    figures[f"{tp2}_step_ms_b{batch}"] / figures[f"{name}_step_ms_b{batch}"]
                )
            kinds = ("all_reduce", "all_gather", "send")
            comm = sum(figures[f"{tp2}_{k}_ms_per_step_b{batch}"] for k in kinds)
            figures[f"{tp2}_communication_share_b{batch}"] = comm / figures[f"{tp2}_step_ms_b{batch}"]
            # the forward's collectives alone (the plan broadcast stays on gloo either way)
            forward = comm - figures[f"{tp2}_send_ms_per_step_b{batch}"]
            figures[f"{tp2}_forward_collectives_share_b{batch}"] = (
                forward / figures[f"{tp2}_step_ms_b{batch}"]
            )
    figures["load_avg_end"] = os.getloadavg()[0]
    return figures


if __name__ == "__main__":
    suite_main(run, __doc__)
