"""Builds of this host's CPU kernels that differ only in `-D` macros, timed side by side in one
process, round by round, so a kernel knob (a prefetch, a block size: PK_GEMM_AHEAD, AMX_KC,
AMX_MC, AMX_MIN_ROWS, ...) is judged on the same minute of a shared machine, not on two runs
minutes apart whose background load differs.

- linears: the Qwen2.5-0.5B's bf16 (or --dtype) linears in model order, 24 layers and the LM
  head, each its own weight, so every pass reads them from memory as a forward does; ms per
  pass, best of 2 per round, every round listed.
  --gguf MIX: the same linears as random ggml blocks of MIX (Q4_0, Q8_0, Q4_K_M: bench.gguf_linears),
  the GGUF kernels (kernels/cpu_gguf.c). Each row count lists the builds' max |diff| of y.
- decode: the fast CPU forward of the random 0.5B-shaped model (or --model), one worker per build, decode
  steps of `batch` sequences with 128-token prompts (--context) (bench.common.decode_steps_lockstep):
  median ms per step, two sets.
- prefill: one prompt of each length, a step per round (bench.amx_ab.prefill_seconds).
- attention: the decode attention alone (paged_attention), the 0.5B's geometry (14 query heads,
  2 kv heads, head_dim 64) over bf16 pools of 24 layers at --context keys, blocks of 16 in a
  shuffled order, one call per layer: ms per 24 calls, best of each round. The pools outgrow
  the caches as a forward's do (--attention-layers 1: one layer's pools 24 times, in cache: the
  arithmetic alone).
- prompt attention: the same for one whole prompt of each length (--prompt-attention): the
  prefill tiles (attend_tile, or the AMX prefill tiles where they run).

The first build is the control: each figure's `ratio` is control / build (> 1: the build is
faster). Not part of `make bench`: a tool for kernel work, printing JSON.

    python -m bench.build_ab -D PK_GEMM_AHEAD=0 -D PK_GEMM_AHEAD=1 \\
        [--variant avx512bf16] [--dtype bfloat16] [--rows 1,16,64,256] [--decode 1,16,64] [--prefill 256]
        [--attention 16 --context 1024] [--prompt-attention 256,1024]

`-D "AMX_KC=512 AMX_MC=128"` defines several macros in one build; `-D @HEAD` (or `-D "@REV X=1"`)
builds the kernels of a git revision, to time a rewrite against the code it replaces.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import tempfile
from pathlib import Path

import torch

from bench.ceilings import best_seconds, engine_rate_gflops, model_gemm_shapes
from bench.common import decode_steps_lockstep, median, paged_decode_attention, random_decode_layout
from bench.report import machine
from kernels import cpu_build, cpu_variants
from worker.cpu_weights import PanelLinear
from worker.default_model import PRESETS

MODEL = "random:qwen2.5-0.5b"
# every weight GEMM of one 0.5B forward, in model order (fused q|k|v and gate|up, the LM head last)
QWEN05_LINEARS = model_gemm_shapes(PRESETS["qwen2.5-0.5b"])


def _kernel_sources(rev: str, out_dir: Path) -> Path:
    """kernels/ as of the git revision `rev`, extracted under out_dir."""
    root = Path(__file__).resolve().parents[1]
    dest = out_dir / f"src-{rev.replace('/', '_')}"
    if dest.exists():  # a second build of the same revision
        return dest / "kernels"
    dest.mkdir()
    git = ["git", "-C", str(root), "archive", rev, "kernels"]
    archive = subprocess.run(git, capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True)
    return dest / "kernels"


def build_all(defines: list[str], variant_name: str | None, out_dir: Path) -> dict[str, cpu_build.CpuOps]:
    """One library per `defines` entry, of `variant_name` (default: the best this CPU runs). An
    entry's `@REV` word builds the kernel sources of that git revision instead of the tree's."""
    variants = cpu_variants.usable_variants()
    variant = next((v for v in variants if v.name == variant_name), None) if variant_name else variants[0]
    if variant is None:
        usable = ", ".join(v.name for v in variants)
        raise SystemExit(f"variant {variant_name} does not run here (usable: {usable})")
    cc = cpu_build.compiler_command()
    if cc is None:
        raise SystemExit("no C compiler: the builds need one")
    ops = {}
    for i, define in enumerate(defines):
        words = define.split()
        revs = [w[1:] for w in words if w.startswith("@")]
        sources = _kernel_sources(revs[0], out_dir) if revs else cpu_build.HERE
        flags = tuple(f"-D{d}" for d in words if not d.startswith("@"))
        out = out_dir / f"build{i}-{variant.name}.so"
        built = dataclasses.replace(variant, flags=(*variant.flags, *flags))
        names = tuple(n for n in cpu_build.SOURCES if (sources / n).exists())  # an old revision's units
        cpu_build.compile_variant(built, out, cc, sources, names)
        ops[define] = cpu_build.CpuOps(out, variant.name, f"build_ab {define}")
    return ops


def _model_linears(ops: dict, dtype: torch.dtype, gguf: str | None) -> tuple[list, dict]:
    """(shapes [(n, k)...], {build: [linear...]}): the 0.5B's linears in model order, as bf16 /
    fp16 / fp32 panels or (gguf) as random ggml blocks of that mix (bench.gguf_linears)."""
    if gguf:
        from bench.gguf_linears import linears as gguf_linears
        from bench.gguf_linears import shape_model

        model = shape_model(gguf)
        layers = {key: gguf_linears(o, model) for key, o in ops.items()}
        first = next(iter(layers.values()))
        return [(lin.out_features, lin.in_features) for lin in first], layers
    weights = [torch.randn(n, k).to(dtype) for n, k in QWEN05_LINEARS]
    return QWEN05_LINEARS, {key: [PanelLinear(o, w, None, dtype) for w in weights] for key, o in ops.items()}


def linears(
    ops: dict, dtype: torch.dtype, rows_list: list[int], rounds: int = 3, gguf: str | None = None
) -> dict:
    if not rows_list:
        return {}
    shapes, layers = _model_linears(ops, dtype, gguf)
    res = {}
    for rows in rows_list:
        xs = {k: torch.randn(rows, k) for _, k in shapes}
        outs = {key: [torch.empty(rows, n) for n, _ in shapes] for key in ops}
        times: dict[str, list[float]] = {key: [] for key in ops}
        for _ in range(rounds):
            for key, lins in layers.items():

                def one_pass(lins=lins, xs=xs, outs=outs[key]) -> None:
                    for (_, k), lin, out in zip(shapes, lins, outs, strict=True):
                        lin(xs[k], out=out)

                times[key].append(round(best_seconds(one_pass, 2) * 1e3, 2))
        res[f"rows_{rows}"] = _with_ratio(times, min)
        first = outs[next(iter(ops))]
        for key in list(ops)[1:]:  # the same inputs: a rewrite that keeps the sums shows 0.0
            diff = max(_finite_diff(a, b) for a, b in zip(outs[key], first, strict=True))
            res[f"rows_{rows}"][key]["max_abs_diff"] = diff
    return res


def _finite_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| where both are finite (random GGUF blocks hold inf / NaN scales), inf where
    only one is."""
    fa, fb = torch.isfinite(a), torch.isfinite(b)
    if not torch.equal(fa, fb):
        return float("inf")
    both = fa & fb
    return float((a[both] - b[both]).abs().max()) if both.any() else 0.0


def _with_ratio(times: dict[str, list[float]], pick) -> dict:
    keys = list(times)
    out = {key: {"ms": times[key], "pick_ms": pick(times[key])} for key in keys}
    for key in keys[1:]:
        out[key]["ratio"] = round(pick(times[keys[0]]) / pick(times[key]), 3)
    return out


def build_workers(ops: dict, dtype: str, model: str = MODEL) -> dict:
    """{build: a fast-forward Worker of `model` on that build's kernels}, the heap frozen after
    the load as `serve`'s worker process does."""
    import worker.cpu_forward as cpu_forward
    from pagedkv.heap import frozen_after
    from worker.worker import Worker
    from worker.worker_config import WorkerConfig

    def make(o: cpu_build.CpuOps) -> Worker:
        saved = cpu_forward.load_cpu_ops
        cpu_forward.load_cpu_ops = lambda: o  # FastCpuForward takes the build under test
        try:
            config = WorkerConfig(
                model=model, dtype=dtype, cpu_kernels="fast", kv_cache_memory=2 << 30, max_model_len=2048
            )
            worker = Worker(config)
        finally:
            cpu_forward.load_cpu_ops = saved
        assert worker.fast_forward.ops is o, worker.describe().forward_kernels
        return worker

    return frozen_after(lambda: {key: make(o) for key, o in ops.items()})()


def forward_steps(
    ops: dict, dtype: str, batches: list[int], prefills: list[int], context: int = 128, model: str = MODEL
) -> dict:
    from bench.amx_ab import prefill_seconds

    if not batches and not prefills:
        return {}
    workers = build_workers(ops, dtype, model)
    res = {}
    for batch in batches:
        sets = [decode_steps_lockstep(workers, steps=8, batch=batch, prompt_len=context) for _ in range(2)]
        times = {key: [round(s[key] * 1e3, 2) for s in sets] for key in workers}
        res[f"decode_b{batch}"] = _with_ratio(times, median)
    for length in prefills:
        seconds = prefill_seconds(workers, length, rounds=3)
        times = {key: [round(s * 1e3, 2)] for key, s in seconds.items()}
        res[f"prefill_{length}"] = _with_ratio(times, median)
    return res


ATTENTION_GEOMETRY = (14, 2, 64, 16)  # the 0.5B's query heads, kv heads, head_dim; blocks of 16


def _attention_case(batch: int, context: int, layers: int, gen: torch.Generator, prompt: bool = False):
    """(query, step): bf16 pools of `layers` layers, a shuffled block table, and a step that calls
    the attention once per each of 24 layers into `out`: `batch` decode rows at `context` keys,
    or (prompt) one whole prompt of `context` tokens, the prefill tiles' work."""
    from kernels.cpu_build import DTYPES

    heads, kv_heads, dim, block_size = ATTENTION_GEOMETRY
    blocks, tables, lens, qsl = random_decode_layout(batch, context, block_size, gen)
    rows = batch
    if prompt:
        qsl, rows = torch.tensor([0, context], dtype=torch.int32), context
    shape = (blocks + 1, block_size, kv_heads, dim)
    pools = [[torch.randn(*shape, generator=gen).bfloat16() for _ in range(2)] for _ in range(layers)]
    query, none = torch.randn(rows, heads, dim, generator=gen), torch.zeros(1, dtype=torch.uint8)

    def step(o: cpu_build.CpuOps, out: torch.Tensor) -> None:
        for layer in range(24):
            k, v = pools[layer % layers]
            paged_decode_attention(o, out, query, k, v, DTYPES["bfloat16"], none, none, tables, lens, qsl)

    return query, step


def attention(ops: dict, cases: list[tuple[str, int, int, bool]], layers: int, rounds: int = 6) -> dict:
    """cases: (name, batch, context, prompt) as _attention_case takes them."""
    gen = torch.Generator().manual_seed(0)
    res = {}
    for name, batch, context, prompt in cases:
        query, step = _attention_case(batch, context, layers, gen, prompt)
        outs = {key: torch.empty_like(query) for key in ops}
        times: dict[str, list[float]] = {key: [] for key in ops}
        for _ in range(rounds):
            for key, o in ops.items():
                seconds = best_seconds(lambda o=o, out=outs[key], step=step: step(o, out), 1)
                times[key].append(round(seconds * 1e3, 2))
        first = outs[next(iter(ops))]
        res[name] = _with_ratio(times, min)
        for key in list(ops)[1:]:
            res[name][key]["max_abs_diff"] = float((outs[key] - first).abs().max())
    return res


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-D", dest="defines", action="append", required=True, help="a build's macros (2+ builds)")
    ap.add_argument("--variant", help="kernel variant to build (default: the best this CPU runs)")
    ap.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16", "float16"))
    mixes = ("Q4_0", "Q4_1", "Q8_0", "Q4_K_M")
    ap.add_argument("--gguf", choices=mixes, help="linears: ggml blocks of this mix")
    ap.add_argument("--model", default=MODEL, help="decode / prefill: the model (a .gguf file: its blocks)")
    ap.add_argument("--rows", type=_ints, default=[1, 16, 64, 256], help="linears: row counts ('' for none)")
    ap.add_argument("--decode", type=_ints, default=[1, 16, 64], help="decode batch sizes ('' for none)")
    ap.add_argument("--context", type=int, default=128, help="decode / attention: keys a sequence attends to")
    ap.add_argument("--attention", type=_ints, default=[], help="decode attention alone: batch sizes")
    ap.add_argument("--prompt-attention", type=_ints, default=[], help="prefill attention: prompt lengths")
    ap.add_argument("--attention-layers", type=int, default=24, help="attention: distinct layers' pools")
    ap.add_argument("--prefill", type=_ints, default=[256], help="prefill lengths ('' for none)")
    args = ap.parse_args()
    if len(args.defines) < 2:
        ap.error("give two or more -D builds (the first is the control)")
    cases = [(f"attention_b{b}", b, args.context, False) for b in args.attention]
    cases += [(f"prompt_attention_{n}", 1, n, True) for n in args.prompt_attention]
    with tempfile.TemporaryDirectory(prefix="pagedkv-build-ab-") as tmp:
        ops = build_all(args.defines, args.variant, Path(tmp))
        res = {
            "machine": machine(),  # the host's model and flags: figures from two hosts never compare
            "variant": next(iter(ops.values())).variant,
            "threads": torch.get_num_threads(),
            "loadavg_before": open("/proc/loadavg").read().split()[:3],
            "engine_rate_before": engine_rate_gflops(torch.get_num_threads()),
            "linears": linears(ops, getattr(torch, args.dtype), args.rows, gguf=args.gguf),
            "forward": forward_steps(ops, args.dtype, args.decode, args.prefill, args.context, args.model),
            "attention": attention(ops, cases, args.attention_layers),
            "loadavg_after": open("/proc/loadavg").read().split()[:3],
            "engine_rate_after": engine_rate_gflops(torch.get_num_threads()),
        }
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
