"""GPU benchmarks (`make bench-gpu` = `python -m bench.gpu`); without a GPU it says so and exits 0.

1. device-to-device copy bandwidth (the roofline the decode kernel is measured against);
2. paged decode attention, fp16, head_dim 128, 32 query / 8 KV heads, block 16, at batch
   1/16/64 x context 512/4096/16384: achieved bandwidth = K/V bytes read / time, as a
   fraction of the copy bandwidth (goal >= 0.8), and time relative to torch's
   scaled_dot_product_attention on contiguous copies of the same K/V;
3. decode step of the embedded default model, CUDA graph vs eager, at batch 1 and 32;
4. end-to-end decode tokens/s of random:qwen2.5-0.5b (~0.5B parameters, bf16) at batch 1/32.

Timing: CUDA events, median of repeated runs after warm-up. Results: printed, and written
as JSON to bench/results/gpu-<date>-<commit>.json.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from bench.report import commit
from control_plane.plan import ContinuingSequence, NewSequence, Plan, SamplingParams

RESULTS_DIR = Path(__file__).parent / "results"
WARMUP, REPEATS = 5, 30
GREEDY = SamplingParams(temperature=0.0)


def cuda_time_ms(fn: Callable[[], object], warmup: int = WARMUP, repeats: int = REPEATS) -> float:
    """Median milliseconds of `fn` on the current stream, measured with CUDA events."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def copy_bandwidth_gbs(num_bytes: int = 1 << 30) -> float:
    src = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = cuda_time_ms(lambda: dst.copy_(src))
    return 2 * num_bytes / ms / 1e6  # read + write


def decode_attention(backend, batch: int, context: int, copy_gbs: float) -> dict:
    heads, kv_heads, head_dim, block_size, dtype = 32, 8, 128, 16, torch.float16
    blocks_per_seq = context // block_size
    num_blocks = batch * blocks_per_seq + 1
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, dtype=dtype, device="cuda")
    v_cache = torch.randn_like(k_cache)
    tables = (torch.randperm(num_blocks - 1, device="cuda") + 1).to(torch.int32).view(batch, blocks_per_seq)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    qsl = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
    query = torch.randn(batch, heads, head_dim, dtype=dtype, device="cuda")
    scale = head_dim**-0.5
    paged_ms = cuda_time_ms(
        lambda: backend.paged_attention(query, k_cache, v_cache, tables, seq_lens, qsl, scale, 1, context)
    )
    keys = k_cache[tables.long()].view(batch, context, kv_heads, head_dim).transpose(1, 2).contiguous()
    values = v_cache[tables.long()].view(batch, context, kv_heads, head_dim).transpose(1, 2).contiguous()
    q = query.view(batch, heads, 1, head_dim)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    sdpa_ms = cuda_time_ms(lambda: sdpa(q, keys, values, scale=scale, enable_gqa=True))
    kv_bytes = 2 * batch * context * kv_heads * head_dim * 2
    achieved = kv_bytes / paged_ms / 1e6
    return {
        "batch": batch,
        "context": context,
        "paged_ms": paged_ms,
        "sdpa_contiguous_ms": sdpa_ms,
        "paged_over_sdpa_time": paged_ms / sdpa_ms,
        "kv_gb_per_s": achieved,
        "fraction_of_copy_bandwidth": achieved / copy_gbs,
    }


def decode_step_ms(model: str | None, batch: int, cuda_graph: bool, steps: int = 40) -> float:
    """Median worker.execute time of a decode step of `batch` sequences (128-token prompts)."""
    from worker import Worker, WorkerConfig

    worker = Worker(WorkerConfig(model=model, device="cuda", cuda_graph=cuda_graph, max_model_len=1024))
    block_size = worker.describe().block_size
    blocks_per_seq = -(-(128 + steps + WARMUP + 1) // block_size)
    tables = {s: list(range(1 + s * blocks_per_seq, 1 + (s + 1) * blocks_per_seq)) for s in range(batch)}
    prompt = [i % 200 + 1 for i in range(128)]
    new = [NewSequence(s, tables[s], prompt, 0, GREEDY, True) for s in range(batch)]
    last = {o.seq_id: o.token_ids[0] for o in worker.execute(Plan(step_id=0, new=new)).outputs}
    times = []
    for step in range(1, steps + WARMUP + 1):
        plan = Plan(
            step_id=step,
            continuing=[ContinuingSequence(s, [], [], [last[s]], 127 + step, True) for s in range(batch)],
        )
        torch.cuda.synchronize()
        started = time.perf_counter()
        result = worker.execute(plan)  # sampling reads tokens back: the step is complete here
        times.append((time.perf_counter() - started) * 1e3)
        last = {o.seq_id: o.token_ids[0] for o in result.outputs}
    return statistics.median(times[WARMUP:])


def main() -> int:
    if not torch.cuda.is_available():
        print("bench.gpu: no CUDA device (torch.cuda.is_available() is False); nothing to measure.")
        return 0
    from worker.backends.cuda import CudaAttentionBackend

    backend = CudaAttentionBackend("cuda")
    results: dict = {"device": torch.cuda.get_device_name(), "arch": backend.driver.arch, "commit": commit()}
    results["copy_gb_per_s"] = copy_gbs = copy_bandwidth_gbs()
    print(f"device {results['device']} ({results['arch']}): copy bandwidth {copy_gbs:.0f} GB/s")
    results["decode_attention"] = []
    for batch in (1, 16, 64):
        for context in (512, 4096, 16384):
            row = decode_attention(backend, batch, context, copy_gbs)
            results["decode_attention"].append(row)
            fraction, ratio = row["fraction_of_copy_bandwidth"], row["paged_over_sdpa_time"]
            print(
                f"decode b={batch:>2} ctx={context:>5}: {row['paged_ms']:.3f} ms, "
                f"{row['kv_gb_per_s']:.0f} GB/s ({fraction:.0%} of copy), paged/sdpa time {ratio:.2f}"
            )
            torch.cuda.empty_cache()
    results["default_model_step_ms"] = {}
    for batch in (1, 32):
        graph = decode_step_ms(None, batch, cuda_graph=True)
        eager = decode_step_ms(None, batch, cuda_graph=False)
        results["default_model_step_ms"][str(batch)] = {
            "graph": graph,
            "eager": eager,
            "speedup": eager / graph,
        }
        print(
            f"default model decode b={batch}: graph {graph:.3f} ms, eager {eager:.3f} ms, "
            f"{eager / graph:.1f}x"
        )
    results["qwen2.5_0.5b_tokens_per_s"] = {}
    for batch in (1, 32):
        ms = decode_step_ms("random:qwen2.5-0.5b", batch, cuda_graph=True)
        results["qwen2.5_0.5b_tokens_per_s"][str(batch)] = batch * 1e3 / ms
        print(f"random:qwen2.5-0.5b decode b={batch}: {ms:.2f} ms/step, {batch * 1e3 / ms:.0f} tokens/s")
    # The comparisons `make bench`'s report gathers into its ratio table (bench/report.py).
    results["ratios"] = {
        **{
            f"paged_over_sdpa_time_b{row['batch']}_ctx{row['context']}": row["paged_over_sdpa_time"]
            for row in results["decode_attention"]
        },
        **{
            f"graph_speedup_over_eager_b{batch}": step["speedup"]
            for batch, step in results["default_model_step_ms"].items()
        },
    }
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"gpu-{time.strftime('%Y%m%d')}-{results['commit']}.json"
    path.write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
