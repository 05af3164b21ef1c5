"""Builds of this host's CPU kernels timed in pairs: bench.build_ab's builds (`-D` macros, `@REV`),
but each round runs one pass of every build back to back (the order alternating round by round)
and keeps the ratio control / build *of that round*; it prints the median and quartiles of those
ratios. On a host whose matrix-engine rate moves 2-4x within minutes (the Sapphire-Rapids-class
VM of docs/PERF.md: its `tdpbf16ps` loop ran 950 to 4,316 GFLOP/s within an hour), the best of
each build over the rounds compares different minutes; a ratio inside one round does not.

- linears: the Qwen2.5-0.5B's bf16 linears in model order, each its own weight (the LM head last
  unless --no-lm-head, which a prefill runs on one row), one pass per build per round;
- prefill: one prompt of each --prefill length, a step per build per round;
- decode: --decode sequences of 128-token prompts, the builds' engines stepped in turn; each full
  decode step is a round (bench.common.decode_step_samples; prefill: bench.amx_ab.prefill_samples).

The first build is the control; ratio > 1: the build is faster. A tool for kernel work, not part
of `make bench`:

    python -m bench.paired_ab -D AMX_PF_C=0 -D AMX_PF_C=1 [--rows 64,256,1024] [--no-lm-head]
        [--prefill 256,1024] [--decode 16,64] [--rounds 15] [--variant avx512amx]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench.amx_ab import prefill_samples
from bench.build_ab import QWEN05_LINEARS, _ints, build_all, build_workers
from bench.ceilings import engine_rate_gflops
from bench.common import decode_step_samples, in_turn
from bench.report import machine
from worker.cpu_weights import PanelLinear


def paired_summary(control: list[float], build: list[float]) -> dict:
    """The per-round ratios control / build of two equally long lists of seconds: median and
    quartiles, and each side's median seconds."""
    ratios = [c / b for c, b in zip(control, build, strict=True)]
    q1, _, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else (ratios[0],) * 3
    return {
        "ratio_median": round(statistics.median(ratios), 3),
        "ratio_q1": round(q1, 3),
        "ratio_q3": round(q3, 3),
        "control_median_ms": round(statistics.median(control) * 1e3, 2),
        "build_median_ms": round(statistics.median(build) * 1e3, 2),
        "rounds": len(ratios),
    }


def _summaries(times: dict[str, list[float]]) -> dict:
    keys = list(times)
    return {key: paired_summary(times[keys[0]], times[key]) for key in keys[1:]}


def linears(ops: dict, rows_list: list[int], rounds: int, lm_head: bool) -> dict:
    shapes = QWEN05_LINEARS if lm_head else QWEN05_LINEARS[:-1]
    weights = [torch.randn(n, k).to(torch.bfloat16) for n, k in shapes]
    layers = {key: [PanelLinear(o, w, None, torch.bfloat16) for w in weights] for key, o in ops.items()}
    res = {}
    for rows in rows_list:
        xs = {k: torch.randn(rows, k) for _, k in shapes}
        outs = [torch.empty(rows, n) for n, _ in shapes]

        def one_pass(key: str, xs=xs, outs=outs) -> float:
            start = time.perf_counter()
            for (_, k), lin, out in zip(shapes, layers[key], outs, strict=True):
                lin(xs[k], out=out)
            return time.perf_counter() - start

        for key in ops:  # warm-up
            one_pass(key)
        times: dict[str, list[float]] = {key: [] for key in ops}
        for r in range(rounds):
            for key in in_turn(ops, r):
                times[key].append(one_pass(key))
        res[f"rows_{rows}"] = _summaries(times)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-D", dest="defines", action="append", required=True, help="a build's macros (2+ builds)")
    ap.add_argument("--variant", help="kernel variant to build (default: the best this CPU runs)")
    ap.add_argument("--rows", type=_ints, default=[64, 256, 1024], help="linears: row counts ('' for none)")
    ap.add_argument("--no-lm-head", action="store_true", help="linears: without the LM head")
    ap.add_argument("--prefill", type=_ints, default=[], help="prefill lengths")
    ap.add_argument("--decode", type=_ints, default=[], help="decode batch sizes")
    ap.add_argument("--rounds", type=int, default=11)
    args = ap.parse_args()
    if len(args.defines) < 2:
        ap.error("give two or more -D builds (the first is the control)")
    with tempfile.TemporaryDirectory(prefix="pagedkv-paired-ab-") as tmp:
        ops = build_all(args.defines, args.variant, Path(tmp))
        res = {
            "machine": machine(),
            "variant": next(iter(ops.values())).variant,
            "engine_rate_before": engine_rate_gflops(torch.get_num_threads()),
            "linears": linears(ops, args.rows, args.rounds, not args.no_lm_head),
        }
        if args.prefill or args.decode:
            workers = build_workers(ops, "bfloat16")
            res["prefill"] = {
                f"prefill_{n}": _summaries(prefill_samples(workers, n, args.rounds, alternate=True))
                for n in args.prefill
            }
            res["decode"] = {
                f"decode_b{b}": _summaries(
                    decode_step_samples(workers, args.rounds, batch=b, prompt_len=128, alternate=True)
                )
                for b in args.decode
            }
        res["engine_rate_after"] = engine_rate_gflops(torch.get_num_threads())
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
