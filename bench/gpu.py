"""GPU benchmarks (`make bench-gpu` = `python -m bench.gpu [--budget-s S] [--quick]`); without a
CUDA device it says so and exits 0.

What is measured, in this order (bounded sections first; the decode sweep, the longest, last,
so that a short budget truncates it rather than dropping a section):

1. copy: device-to-device copy bandwidth of a 1 GiB tensor, bytes read + written per second,
   the faster of a memcpy and an elementwise kernel (copy_bandwidth says why):
   the ceiling the decode kernel is compared against, measured in the same run;
2. launch: host cost of one kernel launch (KernelArgs packing + cuLaunchKernel of a tiny
   kernel, and the whole backend.write_kv call), time.perf_counter over 1000 launches,
   beside torch's own launch of a tiny op;
3. prefill: backend.paged_attention over 4 x 2048-token causal prompts, fp16 and bf16, in
   TFLOP/s (4 * seq * seq/2 * heads * head_dim per sequence), beside torch SDPA (causal)
   on contiguous K/V;
4. mixed: one call with D decode rows first and P prompts after, num_decode_seqs=D (decode
   rows through the decode kernel, prompts through the prefill kernel) vs num_decode_seqs=0
   (everything through the prefill kernel);
5. steps: a worker's decode step, CUDA graph vs eager, for the embedded default model and
   random:qwen2.5-0.5b, batch 1, 8 and 64: wall ms per worker.execute (tokens come back to the
   host, so each step is complete when it returns);
6. decode: backend.paged_attention with max_query_len=1, fp16, 32 query heads, head_dim 128,
   block 16, GQA groups 4/8/1 (8/4/32 KV heads) x contexts 1k-32k x batches 1/8/64: K/V bytes
   read per second as a fraction of the copy bandwidth; the same kernel over a sequential
   table (each sequence's blocks adjacent, the contiguous layout's memory order); torch SDPA
   (no math fallback) on that contiguous K/V; the paged kernel over fp8_e4m3 and int8 pools of
   the same shape (issue 31: `paged_<dtype>_vs_fp16`, half the bytes). Cases whose pools would
   exceed 40% of free
   GPU memory are skipped with the reason. (A one-block-per-sequence table with
   block_size = context cannot be timed: the kernels are instantiated for block sizes up to
   kernels.specs.MAX_BLOCK_SIZE = 256.)

Sections 5 and 6 (and the attention inputs the kernel sections share) live in
bench/gpu_steps.py and bench/gpu_decode.py; this module runs them all.

Kernel timing (sections 1, 3, 4, 6): one Python call between two CUDA events would time the
host (~100 us of Python and driver calls) rather than a 5-20 us kernel. So each measurement
captures N calls into one CUDA graph (or, when capture fails, queues the N calls eagerly;
the row says which) and reports (end - start) / N, median of REPEATS replays. Before every
replay L2 is flushed by reading a buffer of 4x the L2 size (a read, not a write: a write
would leave dirty lines whose write-back would land inside the timed region). Within a
replay, consecutive calls would hit L2 when a case's K/V is smaller than L2: such a case is
given several independent pool copies (>= 4x L2 in all) that the N calls rotate through, and
is reported `l2_resident` only if the copy cap still leaves it under 2x L2.

A global budget (--budget-s, default 300) stops new cases once spent; what was skipped is
printed and recorded. Results are printed as tables and written (after every section, so a
killed run keeps what it measured) to bench/results/gpu-<date>-<commit>.json.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.gpu_decode import (
    BLOCK,
    HEAD_DIM,
    HEADS,
    SCALE,
    contiguous_kv,
    decode_case,
    decode_cases,
    lengths,
    paged_batch,
    sdpa_ms,
)
from bench.gpu_report import fmt, save, summary
from bench.gpu_steps import STEP_MODELS, model_steps
from bench.gpu_timing import (
    FLUSH_FACTOR,
    MIN_LAUNCHES,
    REPEATS,
    Budget,
    Timer,
    host_us,
    l2_bytes,
    release,
    repeated,
)
from bench.report import commit

RESULTS_DIR = Path(__file__).parent / "results"
DEFAULT_BUDGET_S = 300.0
COPY_BYTES = 1 << 30

PREFILL_SEQS, PREFILL_LEN, PREFILL_KV_HEADS = 4, 2048, 8
MIXED_CASES = (  # (decode rows, their context, prompts, prompt length)
    (32, 2048, 2, 512),
    (8, 8192, 1, 1024),
)


# -- 1. copy bandwidth ---------------------------------------------------------------------


def copy_bandwidth(timer: Timer) -> dict:
    """The faster of two copies: `copy_` (a memcpy, which a graph may hand to the copy engines)
    and an elementwise kernel on the SMs. On the first H200 run the memcpy alone gave 2774 GB/s
    while the decode kernel read K/V at 4.4 TB/s: a ceiling the kernels exceed measures nothing."""
    src = torch.empty(COPY_BYTES // 4, dtype=torch.float32, device="cuda")
    dst = torch.empty_like(src)
    memcpy_ms, memcpy_method = timer.per_call_ms(repeated([lambda: dst.copy_(src)]))
    kernel_ms, kernel_method = timer.per_call_ms(repeated([lambda: torch.mul(src, 1.0, out=dst)]))
    ms, method = min((memcpy_ms, memcpy_method), (kernel_ms, kernel_method))
    return {
        "bytes": COPY_BYTES,
        "ms": ms,
        "gb_per_s": 2 * COPY_BYTES / ms / 1e6,
        "memcpy_gb_per_s": 2 * COPY_BYTES / memcpy_ms / 1e6,
        "kernel_gb_per_s": 2 * COPY_BYTES / kernel_ms / 1e6,
        "method": method,
    }


# -- 2. launch overhead --------------------------------------------------------------------


def launch_overhead(backend) -> dict:
    """write_kv_kernel on one padding token (slot -1: it reads the slot and returns)."""
    from kernels.launch import WRITE_KV_SIGNATURE, KernelArgs, write_kv_launch
    from kernels.specs import cache_ops_program

    spec = cache_ops_program("float16")
    kernel = backend.driver.load(spec, backend.cache)[spec.name_expressions[0]]
    k_cache = torch.zeros(4, 16, 2, 64, dtype=torch.float16, device="cuda")
    v_cache = torch.zeros_like(k_cache)
    key = torch.zeros(1, 2, 64, dtype=torch.float16, device="cuda")
    value = torch.zeros_like(key)
    slots = torch.full((1,), -1, dtype=torch.int64, device="cuda")
    values = (
        *(t.data_ptr() for t in (k_cache, v_cache, key, value, slots)),
        key.stride(0),
        value.stride(0),
        2 * 64,
    )
    config = write_kv_launch(1)
    backend.driver.make_current()
    stream = torch.cuda.current_stream().cuda_stream
    prebuilt = KernelArgs(WRITE_KV_SIGNATURE, values)
    tiny = torch.zeros(16, device="cuda")
    return {
        "kernel_args_us": host_us(lambda: KernelArgs(WRITE_KV_SIGNATURE, values)),
        "launch_prebuilt_args_us": host_us(lambda: kernel.launch(config, prebuilt, stream)),
        "args_and_launch_us": host_us(
            lambda: kernel.launch(config, KernelArgs(WRITE_KV_SIGNATURE, values), stream)
        ),
        "backend_write_kv_us": host_us(lambda: backend.write_kv(k_cache, v_cache, key, value, slots)),
        "torch_tiny_add_us": host_us(lambda: tiny.add_(1.0)),
    }


# -- 3. prefill ----------------------------------------------------------------------------


def prefill_case(backend, timer: Timer, dtype: torch.dtype) -> dict:
    seqs = [(PREFILL_LEN, PREFILL_LEN)] * PREFILL_SEQS
    batch = paged_batch([ctx for ctx, _ in seqs], PREFILL_KV_HEADS, dtype)
    seq_lens, qsl = lengths(seqs)
    query = torch.randn(PREFILL_SEQS * PREFILL_LEN, HEADS, HEAD_DIM, dtype=dtype, device="cuda")
    table = batch.shuffled[0]
    call = functools.partial(
        backend.paged_attention,
        query,
        batch.k,
        batch.v,
        table,
        seq_lens,
        qsl,
        SCALE,
        PREFILL_LEN,
        PREFILL_LEN,
    )
    paged, method = timer.per_call_ms(repeated([call]))
    k, v = contiguous_kv(batch, 0, PREFILL_SEQS, PREFILL_LEN)
    q = query.view(PREFILL_SEQS, PREFILL_LEN, HEADS, HEAD_DIM).transpose(1, 2)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    causal = functools.partial(sdpa, q, k, v, is_causal=True, scale=SCALE, enable_gqa=True)
    reference, reference_method = sdpa_ms(timer, repeated([causal]))
    flops = PREFILL_SEQS * 4 * PREFILL_LEN * (PREFILL_LEN / 2) * HEADS * HEAD_DIM
    return {
        "dtype": str(dtype).removeprefix("torch."),
        "seqs": PREFILL_SEQS,
        "seq_len": PREFILL_LEN,
        "kv_heads": PREFILL_KV_HEADS,
        "paged_ms": paged,
        "paged_tflops": flops / paged / 1e9,
        "method": method,
        "sdpa_ms": reference,
        "sdpa_tflops": None if reference is None else flops / reference / 1e9,
        "sdpa_method": reference_method,
        "note": None if reference is not None else reference_method,
    }


# -- 4. mixed decode + prefill -------------------------------------------------------------


def mixed_case(backend, timer: Timer, decodes: int, context: int, prompts: int, prompt_len: int) -> dict:
    """The same batch with num_decode_seqs = D (two kernels) and 0 (the prefill kernel for all),
    plus its two halves alone for reference."""
    seqs = [(context, 1)] * decodes + [(prompt_len, prompt_len)] * prompts
    batch = paged_batch([ctx for ctx, _ in seqs], PREFILL_KV_HEADS, torch.float16)
    seq_lens, qsl = lengths(seqs)
    rows = decodes + prompts * prompt_len
    query = torch.randn(rows, HEADS, HEAD_DIM, dtype=torch.float16, device="cuda")
    table = batch.shuffled[0]
    attend = functools.partial(backend.paged_attention, k_cache=batch.k, v_cache=batch.v, scale=SCALE)

    def timed(q, t, lens, starts, max_q, declared):
        call = functools.partial(
            attend,
            q,
            block_tables=t,
            seq_lens=lens,
            query_start_loc=starts,
            max_query_len=max_q,
            max_seq_len=max(context, prompt_len),
            num_decode_seqs=declared,
        )
        return timer.per_call_ms(repeated([call]))

    split, method = timed(query, table, seq_lens, qsl, prompt_len, decodes)
    all_prefill, _ = timed(query, table, seq_lens, qsl, prompt_len, 0)
    decode_only, _ = timed(
        query[:decodes], table[:decodes], seq_lens[:decodes], qsl[: decodes + 1], 1, decodes
    )
    prefill_only, _ = timed(
        query[decodes:], table[decodes:], seq_lens[decodes:], qsl[decodes:] - decodes, prompt_len, 0
    )
    kv_bytes = 2 * batch.blocks_per_copy * BLOCK * PREFILL_KV_HEADS * HEAD_DIM * 2
    return {
        "decodes": decodes,
        "decode_context": context,
        "prompts": prompts,
        "prompt_len": prompt_len,
        "split_ms": split,
        "all_prefill_kernel_ms": all_prefill,
        "speedup": all_prefill / split,
        "decode_only_ms": decode_only,
        "prefill_only_ms": prefill_only,
        "method": method,
        "l2_resident": kv_bytes < 2 * timer.l2,
    }


# -- driver --------------------------------------------------------------------------------


@dataclass
class Run:
    backend: object
    timer: Timer
    budget: Budget
    results: dict
    path: Path
    quick: bool
    errors: int = 0

    def attempt(self, name: str, measure: Callable[[], dict]) -> dict | None:
        """One case: its row, or None (budget spent); an exception becomes an error row so the
        remaining cases still run (the exit status reports it)."""
        if not self.budget.allows(name):
            return None
        try:
            row = measure()
        except torch.cuda.OutOfMemoryError as exc:
            row = {"case": name, "skipped": f"out of memory: {str(exc).splitlines()[0][:120]}"}
        except Exception as exc:  # noqa: BLE001 - recorded, reported by the exit status
            self.errors += 1
            row = {"case": name, "error": f"{type(exc).__name__}: {exc}"}
        release()
        self.results["skipped"] = self.budget.skipped
        return row


def progress(name: str, row: dict, keys: Sequence[str]) -> None:
    """One line as a case finishes (the tables come at the end)."""
    if "error" in row or "skipped" in row:
        print(f"{name}: {row.get('error') or row.get('skipped')}")
        return
    print(f"{name}: " + ", ".join(f"{key} {fmt(row.get(key))}" for key in keys))


def section_launch(run: Run) -> None:
    row = run.attempt("launch overhead", lambda: launch_overhead(run.backend))
    if row is not None:
        run.results["launch_overhead_us"] = row
        progress("launch overhead (host us)", row, tuple(row))


def section_prefill(run: Run) -> None:
    for dtype in (torch.float16, torch.bfloat16):
        row = run.attempt(f"prefill {dtype}", lambda d=dtype: prefill_case(run.backend, run.timer, d))
        if row is not None:
            run.results.setdefault("prefill", []).append(row)
            progress(f"prefill {dtype}", row, ("paged_tflops", "sdpa_tflops"))
            save(run.results, run.path)


def section_mixed(run: Run) -> None:
    for decodes, context, prompts, prompt_len in MIXED_CASES:
        name = f"mixed D{decodes}@{context} + {prompts}x{prompt_len}"
        row = run.attempt(
            name, lambda c=(decodes, context, prompts, prompt_len): mixed_case(run.backend, run.timer, *c)
        )
        if row is not None:
            run.results.setdefault("mixed", []).append(row)
            progress(name, row, ("split_ms", "all_prefill_kernel_ms", "speedup"))
            save(run.results, run.path)


def section_decode(run: Run) -> None:
    copy_gbs = run.results["copy"]["gb_per_s"]
    for case in decode_cases(run.quick):
        row = run.attempt(case.name, lambda c=case: decode_case(run.backend, run.timer, c, copy_gbs))
        if row is None:
            continue
        run.results.setdefault("decode", []).append(row)
        keys = (
            "paged_ms",
            "paged_fraction_of_copy",
            "paged_contiguous_ms",
            "paged_int8_vs_fp16",
            "sdpa_ms",
            "plan",
        )
        progress(case.name, row, keys)
        save(run.results, run.path)


def section_steps(run: Run) -> None:
    for model in STEP_MODELS:
        try:
            rows = model_steps(model, run.budget)
        except Exception as exc:  # noqa: BLE001 - recorded, reported by the exit status
            run.errors += 1
            rows = [{"model": model or "default", "error": f"{type(exc).__name__}: {exc}"}]
            release()
        for row in rows:
            progress(f"steps {row['model']} b={row.get('batch')}", row, ("graph_ms", "eager_ms", "speedup"))
        run.results.setdefault("steps", []).extend(rows)
        run.results["skipped"] = run.budget.skipped
        save(run.results, run.path)


def environment(backend, l2: int, args: argparse.Namespace) -> dict:
    from kernels.nvrtc import nvrtc_version

    return {
        "device": torch.cuda.get_device_name(),
        "arch": backend.driver.arch,
        "sms": backend.driver.num_sms,
        "l2_bytes": l2,
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "driver_version": backend.driver.driver_version,
        "nvrtc": ".".join(map(str, nvrtc_version())),
        "commit": commit(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "geometry": {
            "heads": HEADS,
            "head_dim": HEAD_DIM,
            "block": BLOCK,
            "prefill_seqs": PREFILL_SEQS,
            "prefill_len": PREFILL_LEN,
            "prefill_kv_heads": PREFILL_KV_HEADS,
        },
        "budget_s": args.budget_s,
        "quick": args.quick,
        "timing": f"CUDA graph of >= {MIN_LAUNCHES} calls (or queued), median of {REPEATS} replays, "
        f"L2 flushed by reading {FLUSH_FACTOR}x L2 before each, pools rotated to >= {FLUSH_FACTOR}x L2",
    }


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--budget-s", type=float, default=DEFAULT_BUDGET_S, help="stop adding cases after this"
    )
    parser.add_argument("--quick", action="store_true", help="a few decode cases only (smoke run)")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench.gpu: no CUDA device (torch.cuda.is_available() is False); nothing to measure.")
        return 0
    from worker.backends.cuda import CudaAttentionBackend

    backend = CudaAttentionBackend("cuda")
    l2 = l2_bytes()
    results = environment(backend, l2, args)
    path = RESULTS_DIR / f"gpu-{time.strftime('%Y%m%d')}-{results['commit']}.json"
    run = Run(backend, Timer(l2), Budget(args.budget_s), results, path, args.quick)
    results["copy"] = copy_bandwidth(run.timer)  # every fraction below needs it: no budget check
    print(f"device {results['device']} ({results['arch']}): copy {results['copy']['gb_per_s']:.0f} GB/s")
    save(results, path)
    # Bounded sections first; the decode sweep, the longest, last: a short budget truncates it
    # (its most common geometry, GQA 4, comes first) rather than dropping a whole section.
    for section in (section_launch, section_prefill, section_mixed, section_steps, section_decode):
        section(run)
    results["errors"] = run.errors
    save(results, path)
    print()
    print(summary(results))
    print(f"wrote {path}")
    return 1 if run.errors else 0


if __name__ == "__main__":
    sys.exit(main())
