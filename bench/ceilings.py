"""Machine ceilings that benchmark reports divide by (pure measurement, no pagedkv code).

- `memory_read_bandwidth_gbs`: a streaming read of a large buffer with the widest vector loads
  the CPU has (bench/ceilings.c). Decode at batch 1 reads every weight once per token, so
  weight bytes / this bandwidth is the fastest a token can be. torch's own sum reads ~40 %
  slower than the memory system can (../shared/notes/peer-llamacpp-cpu.md), which would
  flatter every "% of the limit"; and the figure swings minute to minute on shared VMs, so
  measure it in the same run as the timings it divides.
- `isa_peak_gflops`: fp32 FMA throughput of a register-only loop, bf16 dot-product
  (`vdpbf16ps`) throughput where the CPU has avx512_bf16, and AMX tile (`tdpbf16ps`) throughput
  where it has AMX and the kernel grants the tile state.
- `packed_gemm_gflops`: oneDNN's prepacked GEMM on given weight shapes: the "packed GEMM
  ceiling" of prefill and batched decode. In bf16 on an AMX CPU it is oneDNN's AMX brgemm
  (its verbose log names `brg_matmul:..._amx`), so it counts the matrix engine.
- `int8_gemm_gflops`: oneDNN's u8 x s8 -> fp32 quantized linear (`onednn.qlinear_pointwise`,
  AMX int8 brgemm where the CPU has it). `torch._int_mm` is not used: on CPU it reaches oneDNN's
  generic s8 gemm_api, not brgemm, at a fraction of the rate (measured: docs/PERF.md, AMX).
- `matrix_engine`: which engine bounds a bf16 GEMM here ("amx", "avx512_bf16" or "fma"), so
  reports divide by the ceiling of the engine this CPU has (`engine_peak_gflops`).

The C file is compiled at first use with the host's `cc -O3 -march=native -fopenmp` into
~/.cache/pagedkv-bench (keyed by source, compiler and CPU flags) and loaded with ctypes.

    python -m bench.ceilings [bandwidth|isa|gemm|all] [--threads 2] ...   (prints JSON)
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import hashlib
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

from kernels.cpu_variants import cpu_features

SOURCE = Path(__file__).with_name("ceilings.c")
CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pagedkv-bench"
# The batch-size hint oneDNN packs for: the fast CPU forward's (worker/cpu_forward.py).
PACKING_BATCH_HINT = 64


@functools.cache
def _library() -> ctypes.CDLL:
    """Build (once per source/compiler/CPU) and load bench/ceilings.c."""
    compiler = subprocess.run(["cc", "--version"], capture_output=True, text=True, check=True).stdout
    key = hashlib.sha256(SOURCE.read_bytes() + compiler.encode() + " ".join(sorted(cpu_features())).encode())
    lib = CACHE / f"ceilings-{key.hexdigest()[:12]}.so"
    if not lib.exists():
        CACHE.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(
            dir=CACHE
        ) as tmp:  # rename: a concurrent build never loads half a file
            out = Path(tmp) / lib.name
            cmd = ["cc", "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", str(SOURCE), "-o", str(out)]
            subprocess.run(cmd, check=True, capture_output=True)
            os.replace(out, lib)
    so = ctypes.CDLL(str(lib))
    so.ceil_alloc.restype, so.ceil_alloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t, ctypes.c_int]
    so.ceil_free.argtypes = [ctypes.c_void_p]
    so.ceil_read_pass.restype = ctypes.c_double
    so.ceil_read_pass.argtypes = [
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.POINTER(ctypes.c_uint64),
    ]
    for name in ("ceil_fma_fp32", "ceil_dpbf16", "ceil_amx_bf16"):
        fn = getattr(so, name)
        fn.restype, fn.argtypes = (
            ctypes.c_double,
            [ctypes.c_int, ctypes.c_long, ctypes.POINTER(ctypes.c_float)],
        )
    return so


def memory_read_bandwidth_gbs(threads: int = 2, size_bytes: int = 2 << 30, passes: int = 5) -> float:
    """GB/s (1e9 bytes) of the best of `passes` streaming reads of a `size_bytes` buffer, far
    larger than any cache; the first read (page faults, cold TLB) is not counted."""
    lib = _library()
    size = max(size_bytes // 4096, 1) * 4096
    buf = lib.ceil_alloc(size, threads)
    if not buf:
        raise MemoryError(f"ceil_alloc({size}) failed")
    sink = ctypes.c_uint64()
    try:
        lib.ceil_read_pass(buf, size, threads, ctypes.byref(sink))
        best = min(lib.ceil_read_pass(buf, size, threads, ctypes.byref(sink)) for _ in range(passes))
    finally:
        lib.ceil_free(buf)
    return size / best / 1e9


def isa_peak_gflops(threads: int = 2, iters: int = 20_000_000, repeats: int = 3) -> dict:
    """{"fp32": GFLOP/s of FMA chains, "bf16": of vdpbf16ps chains or None without
    avx512_bf16}, best of `repeats`; one FMA = 2 FLOPs per lane."""
    lib = _library()
    sink = ctypes.c_float()
    out = {"fp32": max(lib.ceil_fma_fp32(threads, iters, ctypes.byref(sink)) for _ in range(repeats))}
    has_bf16 = "avx512_bf16" in cpu_features()
    out["bf16"] = (
        max(lib.ceil_dpbf16(threads, iters, ctypes.byref(sink)) for _ in range(repeats)) if has_bf16 else None
    )
    out["amx_bf16"] = None
    if matrix_engine() == "amx":
        # a tdpbf16ps does 32x the work of a vdpbf16ps: fewer iterations for the same time
        rate = max(
            lib.ceil_amx_bf16(threads, max(iters // 32, 1000), ctypes.byref(sink)) for _ in range(repeats)
        )
        out["amx_bf16"] = rate if rate > 0 else None
    return out


def engine_rate_gflops(threads: int = 2) -> dict:
    """{"engine": matrix_engine(), "gflops": engine_peak_gflops of short isa_peak_gflops runs}:
    the rate of this minute, which a kernel A/B prints before and after, because a shared host's
    tile rate can move 4x between minutes (bench/results/amx-spr-2026-12-03.md), and a ratio
    holds only for the machine it was taken on."""
    peaks = isa_peak_gflops(threads, iters=2_000_000, repeats=2)
    return {"engine": matrix_engine(), "gflops": round(engine_peak_gflops(peaks, "bfloat16"), 1)}


def matrix_engine() -> str:
    """What bounds a bf16 GEMM on this CPU: "amx" (flags and the kernel's tile permission, asked
    for this process), "avx512_bf16" (vdpbf16ps) or "fma"."""
    from kernels.cpu_variants import amx_tile_permission  # stdlib only

    flags = cpu_features()
    if {"amx_tile", "amx_bf16"} <= flags and amx_tile_permission() is None:
        return "amx"
    return "avx512_bf16" if "avx512_bf16" in flags else "fma"


def engine_peak_gflops(peaks: dict, dtype: str) -> float | None:
    """The ISA peak a GEMM of `dtype` divides by: the matrix engine's where the CPU has one."""
    if dtype == "float32":
        return peaks.get("fp32")
    return peaks.get("amx_bf16") or peaks.get("bf16") or peaks.get("fp32")


def model_gemm_shapes(config: dict) -> list[tuple[int, int]]:
    """(N, K) of every weight GEMM of one forward of a Llama/Qwen checkpoint's config.json,
    fused the way the fast CPU forward fuses them (q|k|v, gate|up), plus the LM head."""
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    kv = config.get("num_key_value_heads", heads)
    inter = config["intermediate_size"]
    layer = [
        ((heads + 2 * kv) * head_dim, hidden),
        (hidden, heads * head_dim),
        (2 * inter, hidden),
        (hidden, inter),
    ]
    return layer * config["num_hidden_layers"] + [(config["vocab_size"], hidden)]


def best_seconds(run, repeats: int) -> float:
    """The fastest of `repeats` calls of `run()`, after one untimed warm-up call (oneDNN's JIT,
    first-touch pages)."""
    run()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - t0)
    return best


def _gflops_over_shapes(shapes: list[tuple[int, int]], rows: int, make_run, repeats: int) -> float:
    """GFLOP/s of `make_run(n, k)()` (one x[rows, K] @ W[N, K].T) summed over the shapes, each
    distinct shape timed once (its best of `repeats`, after one warm-up call: oneDNN's JIT) and
    weighted by how often it occurs: a model repeats the same few per layer."""
    import torch

    counts: dict[tuple[int, int], int] = {}
    for shape in shapes:
        counts[tuple(shape)] = counts.get(tuple(shape), 0) + 1
    flops = seconds = 0.0
    with torch.inference_mode():
        for (n, k), count in counts.items():
            flops += 2.0 * rows * n * k * count
            seconds += best_seconds(make_run(n, k), repeats) * count
    return flops / seconds / 1e9


def packed_gemm_gflops(
    shapes: list[tuple[int, int]],
    dtype="float32",
    rows: int = 64,
    threads: int | None = None,
    repeats: int = 5,
) -> float:
    """GFLOP/s of oneDNN's prepacked GEMM, x[rows, K] @ W[N, K].T for each (N, K), summed
    over the shapes (each shape's best of `repeats`)."""
    import torch

    if threads:
        torch.set_num_threads(threads)
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype

    def make_run(n: int, k: int):
        packed, x = _packed_weight(n, k, dtype), torch.randn(rows, k).to(dtype)
        return lambda: _packed_linear(x, packed)

    return _gflops_over_shapes(shapes, rows, make_run, repeats)


def _packed_weight(n: int, k: int, dtype):
    """A random W[n, k] in oneDNN's prepacked layout (the best GEMM torch has on a CPU)."""
    import torch

    return torch.ops.mkldnn._reorder_linear_weight(torch.randn(n, k).to(dtype), PACKING_BATCH_HINT)


def _packed_linear(x, packed):
    import torch

    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def streaming_gemm_gflops(
    shapes: list[tuple[int, int]], dtype="bfloat16", rows: int = 64, repeats: int = 3
) -> float:
    """GFLOP/s of oneDNN's prepacked GEMM over one distinct weight per entry of `shapes`, run in
    order as a forward runs its linears: a model's weights larger than the caches stream from
    memory once per step. packed_gemm_gflops repeats one weight per shape, which stays in cache,
    so at few rows (a decode batch) it states a rate no model past the cache size can reach."""
    import torch

    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    with torch.inference_mode():
        weights = [_packed_weight(n, k, dtype) for n, k in shapes]
        inputs = {k: torch.randn(rows, k).to(dtype) for _, k in shapes}

        def one_pass():
            for (_, k), w in zip(shapes, weights, strict=True):
                _packed_linear(inputs[k], w)

        seconds = best_seconds(one_pass, repeats)
    return 2.0 * rows * sum(n * k for n, k in shapes) / seconds / 1e9


def int8_gemm_gflops(
    shapes: list[tuple[int, int]], rows: int = 64, threads: int | None = None, repeats: int = 5
) -> float | None:
    """GFLOP/s (2 ops per multiply-add) of oneDNN's int8 linear, u8 activations x s8 weights
    (per-channel scales) -> fp32, prepacked, on each (N, K), summed like packed_gemm_gflops.
    None where this torch has no oneDNN quantized linear."""
    import torch

    if threads:
        torch.set_num_threads(threads)
    onednn = getattr(torch.ops, "onednn", None)
    if onednn is None or not hasattr(onednn, "qlinear_pointwise"):
        return None

    def make_run(n: int, k: int):
        packed = onednn.qlinear_prepack(torch.randint(-127, 128, (n, k), dtype=torch.int8), [rows, k])
        x = torch.randint(0, 256, (rows, k), dtype=torch.uint8)
        scales, zeros = torch.full((n,), 0.01), torch.zeros(n, dtype=torch.int64)
        return lambda: onednn.qlinear_pointwise(
            x, 0.02, 0, packed, scales, zeros, None, 1.0, 0, torch.float32, "none", [], ""
        )

    return _gflops_over_shapes(shapes, rows, make_run, repeats)


def shape_ceilings(n: int, k: int, rows: int, threads: int, peaks: dict, repeats: int = 5) -> dict:
    """One GEMM shape's ceilings side by side: oneDNN bf16 and int8, the ISA peaks (FMA,
    vdpbf16ps, AMX), and which engine this CPU has."""
    return {
        "shape": [rows, k, n],
        "onednn_bf16_gflops": packed_gemm_gflops([(n, k)], "bfloat16", rows, threads, repeats),
        "onednn_fp32_gflops": packed_gemm_gflops([(n, k)], "float32", rows, threads, repeats),
        "onednn_int8_gflops": int8_gemm_gflops([(n, k)], rows, threads, repeats),
        "fma_fp32_gflops": peaks["fp32"],
        "vdpbf16ps_gflops": peaks["bf16"],
        "amx_bf16_gflops": peaks["amx_bf16"],
        "matrix_engine": matrix_engine(),
    }


# (rows, N, K) of the Qwen2.5-0.5B GEMMs the AMX issue sizes its goals by (gate|up halves, down)
QWEN05_SHAPES = ((256, 4864, 896), (1024, 4864, 896), (256, 896, 4864), (1024, 896, 4864))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", nargs="?", default="all", choices=("bandwidth", "isa", "gemm", "shapes", "all"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--size-bytes", type=int, default=2 << 30, help="bandwidth buffer")
    ap.add_argument("--model", type=Path, help="gemm: a checkpoint dir whose config.json gives the shapes")
    ap.add_argument("--dtype", default="float32", help="gemm: float32 | bfloat16")
    ap.add_argument("--rows", type=int, default=256, help="gemm: M")
    ap.add_argument(
        "--prefill", action="store_true", help="gemm: leave out the LM head (a prefill runs it on one row)"
    )
    args = ap.parse_args()
    out: dict = {"threads": args.threads}
    if args.what in ("bandwidth", "all"):
        out["read_gbs"] = memory_read_bandwidth_gbs(args.threads, args.size_bytes)
    if args.what in ("isa", "shapes", "all"):
        out["isa_gflops"] = isa_peak_gflops(args.threads)
        out["matrix_engine"] = matrix_engine()
    if args.what in ("shapes", "all"):
        out["shapes"] = [
            shape_ceilings(n, k, rows, args.threads, out["isa_gflops"]) for rows, n, k in QWEN05_SHAPES
        ]
    if args.what in ("gemm", "all") and args.model:
        config = json.loads((args.model / "config.json").read_text())
        shapes = model_gemm_shapes(config)[: -1 if args.prefill else None]
        gflops = packed_gemm_gflops(shapes, args.dtype, args.rows, args.threads)
        out["packed_gemm"] = {
            "dtype": args.dtype,
            "rows": args.rows,
            "prefill": args.prefill,
            "gflops": gflops,
        }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
