"""Machine ceilings that benchmark reports divide by (pure measurement, no pagedkv code).

- `memory_read_bandwidth_gbs`: a streaming read of a large buffer with the widest vector loads
  the CPU has (bench/ceilings.c). Decode at batch 1 reads every weight once per token, so
  weight bytes / this bandwidth is the fastest a token can be. torch's own sum reads ~40 %
  slower than the memory system can (../shared/notes/peer-llamacpp-cpu.md), which would
  flatter every "% of the limit"; and the figure swings minute to minute on shared VMs, so
  measure it in the same run as the timings it divides.
- `isa_peak_gflops`: fp32 FMA throughput of a register-only loop, and bf16 dot-product
  (`vdpbf16ps`) throughput where the CPU has avx512_bf16.
- `packed_gemm_gflops`: oneDNN's prepacked GEMM (what the fast CPU forward calls) on given
  weight shapes: the "packed GEMM ceiling" of prefill and batched decode.

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

SOURCE = Path(__file__).with_name("ceilings.c")
CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pagedkv-bench"
# The batch-size hint oneDNN packs for: the fast CPU forward's (worker/cpu_forward.py).
PACKING_BATCH_HINT = 64


def cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


@functools.cache
def _library() -> ctypes.CDLL:
    """Build (once per source/compiler/CPU) and load bench/ceilings.c."""
    compiler = subprocess.run(["cc", "--version"], capture_output=True, text=True, check=True).stdout
    key = hashlib.sha256(SOURCE.read_bytes() + compiler.encode() + " ".join(sorted(cpu_flags())).encode())
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
    for name in ("ceil_fma_fp32", "ceil_dpbf16"):
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
    has_bf16 = "avx512_bf16" in cpu_flags()
    out["bf16"] = (
        max(lib.ceil_dpbf16(threads, iters, ctypes.byref(sink)) for _ in range(repeats)) if has_bf16 else None
    )
    return out


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


def packed_gemm_gflops(
    shapes: list[tuple[int, int]],
    dtype="float32",
    rows: int = 64,
    threads: int | None = None,
    repeats: int = 5,
) -> float:
    """GFLOP/s of oneDNN's prepacked GEMM, x[rows, K] @ W[N, K].T for each (N, K), summed
    over the shapes (each shape's best of `repeats`). Distinct shapes are timed once each:
    a model repeats the same few per layer."""
    import torch

    if threads:
        torch.set_num_threads(threads)
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    counts: dict[tuple[int, int], int] = {}
    for shape in shapes:
        counts[tuple(shape)] = counts.get(tuple(shape), 0) + 1
    flops = seconds = 0.0
    with torch.inference_mode():
        for (n, k), count in counts.items():
            weight = torch.randn(n, k).to(dtype)
            packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACKING_BATCH_HINT)
            x = torch.randn(rows, k).to(dtype)
            torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")  # warm: oneDNN JIT
            best = float("inf")
            for _ in range(repeats):
                t0 = time.perf_counter()
                torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
                best = min(best, time.perf_counter() - t0)
            flops += 2.0 * rows * n * k * count
            seconds += best * count
    return flops / seconds / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", nargs="?", default="all", choices=("bandwidth", "isa", "gemm", "all"))
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
    if args.what in ("isa", "all"):
        out["isa_gflops"] = isa_peak_gflops(args.threads)
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
