"""The CUDA worker's start, checked and recorded (issue 32; `.ci/gpu-device` runs it).

For each configuration the worker starts with `--cuda-graph require` (a failed graph
self-check refuses the start, which fails this run) and the profiled KV sizing; the record is
what it measured: the memory breakdown, the KV pool against the fixed-reserve formula it
replaced (0.8 of the memory free after the weights, minus 1 GiB), the self-check's worst
error and bound, and the start time.

    python -m bench.gpu_startup [--out FILE.json]   (exit 1: a start was refused)
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import sys
import time

import torch

from worker import Worker, WorkerConfig
from worker.errors import WorkerConfigError

CONFIGS = (
    dict(model=None, dtype="float32"),
    dict(model=None, dtype="bfloat16"),
    dict(model=None, dtype="float16"),
    dict(model="random:qwen2.5-0.5b", dtype="bfloat16", max_model_len=8192),
)
OLD_FRACTION, OLD_RESERVE = 0.8, 1 << 30  # the formula before issue 32


def start(settings: dict) -> dict:
    began = time.perf_counter()
    worker = Worker(WorkerConfig(device="cuda", cuda_graph="require", **settings))
    seconds = time.perf_counter() - began
    facts = worker.describe()
    memory = facts.memory
    free_after_weights = memory.total_bytes - memory.weights_bytes - memory.other_bytes
    old_kv = int(free_after_weights * OLD_FRACTION) - OLD_RESERVE
    record = {
        "settings": settings,
        "start_seconds": round(seconds, 2),
        "memory": dataclasses.asdict(memory),
        "num_blocks": facts.num_blocks,
        "kv_vs_fixed_reserve": round(memory.kv_cache_bytes / old_kv, 3) if old_kv > 0 else None,
        "cuda_graphs": facts.cuda_graphs,
        "cuda_graphs_reason": facts.cuda_graphs_reason,
    }
    del worker
    gc.collect()
    torch.cuda.empty_cache()
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_startup", description=__doc__)
    parser.add_argument("--out", help="write the records as JSON here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench.gpu_startup: no CUDA device (torch.cuda.is_available() is False); nothing run")
        return 0
    records, failed = [], False
    for settings in CONFIGS:
        try:
            record = start(settings)
        except WorkerConfigError as exc:
            record, failed = {"settings": settings, "refused": str(exc)}, True
        print(json.dumps(record), flush=True)
        records.append(record)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "starts": records}, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
