"""AMX tiles before and after (issue 38): the fast CPU forward with the avx512bf16 kernels (the
AVX-512 register tiles) and with avx512amx (tdpbf16ps for GEMMs of 16+ rows), in one process,
interleaved round by round so that the background load of a shared machine lands on both alike.

- GEMM GFLOP/s of one bf16 linear at the Qwen2.5-0.5B shapes (bench.ceilings.QWEN05_SHAPES):
  pk_linear of each variant, and oneDNN's prepacked bf16 GEMM (AMX brgemm on an AMX CPU: the
  ceiling), with each kernel's fraction of oneDNN's rate;
- prefill of one 256- and one 1024-token prompt (one step each) on the 0.5B-shaped bf16 model:
  prompt tok/s per variant and its fraction of oneDNN's GEMM rate for the same linears;
- decode step at batch 1, 16 and 64 (128-token prompts): tokens/s per variant and the fraction
  of oneDNN's rate for the step's linears at that batch (LM head included), against two
  ceilings: oneDNN on one weight per shape, repeated (in cache: the issue's), and oneDNN over a
  distinct weight per linear in the model's order (`_streaming`: the weights come from memory
  once per step, as in a real forward of a model larger than the caches).

Only meaningful where the CPU runs both variants (an AMX host); elsewhere it says so and stops.
Prints the load average before and after: the ratios are the figures, absolute rates swing.

Run: `python -m bench.amx_ab [--quick]`.
"""

from __future__ import annotations

import os
import random

import torch

from base.plan import SamplingParams
from bench.ceilings import (
    QWEN05_SHAPES,
    best_seconds,
    engine_rate_gflops,
    packed_gemm_gflops,
    streaming_gemm_gflops,
)
from bench.common import TimedWorker, decode_steps_lockstep, engine_for, in_turn, median
from bench.report import machine
from bench.suite_cli import suite_main
from kernels import cpu_build, cpu_variants
from pagedkv.heap import frozen_after
from worker.cpu_weights import PanelLinear
from worker.worker import Worker
from worker.worker_config import WorkerConfig

VARIANTS = ("avx512bf16", "avx512amx")  # before, after
MODEL = "random:qwen2.5-0.5b"


def _load_variant(name: str) -> cpu_build.CpuOps:
    """`name`'s kernels as load_cpu_ops would pick them with PAGEDKV_CPU_VARIANT=name (the probe
    included); the process-wide cache is cleared so the next worker gets the next variant."""
    saved = os.environ.get(cpu_variants.VARIANT_ENV)
    os.environ[cpu_variants.VARIANT_ENV] = name
    cpu_build.load_cpu_ops.cache_clear()
    try:
        return cpu_build.load_cpu_ops()
    finally:
        if saved is None:
            del os.environ[cpu_variants.VARIANT_ENV]
        else:
            os.environ[cpu_variants.VARIANT_ENV] = saved


def _worker(name: str) -> Worker:
    _load_variant(name)
    worker = Worker(WorkerConfig(model=MODEL, dtype="bfloat16", cpu_kernels="fast", kv_cache_memory=1 << 30,
                                 max_model_len=2048))  # fmt: skip
    cpu_build.load_cpu_ops.cache_clear()
    assert worker.fast_forward.variant == name, worker.describe().forward_kernels
    return worker


def gemm_rates(ops: dict, rounds: int, repeats: int) -> dict:
    """GFLOP/s per shape of each variant's pk_linear and oneDNN, best over interleaved rounds."""
    res = {}
    for rows, n, k in QWEN05_SHAPES:
        gen = torch.Generator().manual_seed(n + k)
        weight, x = torch.randn(n, k, generator=gen).to(torch.bfloat16), torch.randn(rows, k, generator=gen)
        layers = {name: PanelLinear(o, weight, None, torch.bfloat16) for name, o in ops.items()}
        best: dict[str, float] = {}
        for _ in range(rounds):
            for name, layer in layers.items():
                rate = 2 * rows * n * k / best_seconds(lambda layer=layer, x=x: layer(x), repeats) / 1e9
                best[name] = max(best.get(name, 0.0), rate)
            best["onednn"] = max(
                best.get("onednn", 0.0), packed_gemm_gflops([(n, k)], "bfloat16", rows, None, repeats)
            )
        tag = f"gemm_{rows}x{k}x{n}"
        for name, rate in best.items():
            res[f"{tag}_{name}_gflops"] = rate
            if name != "onednn":
                res[f"{tag}_{name}_fraction_of_onednn"] = rate / best["onednn"]
    return res


def layer_shapes(worker: Worker, lm_head: bool) -> list[tuple[int, int]]:
    forward = worker.fast_forward
    shapes = [(forward.lm_head.out_features, forward.lm_head.in_features)] if lm_head else []
    for layer in forward.layers:
        shapes += [
            (lin.out_features, lin.in_features)
            for lin in (layer.qkv, layer.o_proj, layer.gate_up, layer.down)
        ]
    return shapes


def prefill_seconds(workers: dict, length: int, rounds: int) -> dict:
    """Median seconds of a one-prompt prefill step of `length` tokens per worker, interleaved."""
    return {key: median(s) for key, s in prefill_samples(workers, length, rounds).items()}


def prefill_samples(workers: dict, length: int, rounds: int, alternate: bool = False) -> dict:
    """Seconds of `rounds` one-prompt prefill steps of `length` tokens per worker (after one
    warm-up round), the workers in turn within each round (`alternate`: the order reversed every
    other round), the i-th sample of each from the same round."""
    vocab = next(iter(workers.values())).describe().vocab_size
    timed = {key: TimedWorker(w) for key, w in workers.items()}
    engines = {
        key: engine_for(t, max_num_seqs=1, caching=False, budget=max(8192, length))
        for key, t in timed.items()
    }
    for r in range(rounds + 1):  # the first round warms up
        rng = random.Random(r)
        tokens = [rng.randrange(vocab) for _ in range(length)]
        for key in in_turn(engines, r, alternate):
            once = SamplingParams(max_tokens=1, ignore_eos=True)
            engines[key].add_request(f"p{length}-{r}-{key}", tokens, once)
            engines[key].run_to_completion()
    return {key: [s for _, k, s in t.samples if k == length][1:] for key, t in timed.items()}


def run(quick: bool = False) -> dict:
    res: dict = {
        "machine": machine(),  # the host's model and flags: figures from two hosts never compare
        "threads": torch.get_num_threads(),
        "loadavg_before": open("/proc/loadavg").read().split()[:3],
    }
    variants, notes = cpu_variants.choose_variants()
    if not {v.name for v in variants} >= set(VARIANTS):
        res["skipped"] = (
            f"this CPU does not run both {' and '.join(VARIANTS)}: {'; '.join(notes) or 'no AMX'}"
        )
        return res
    ops = {name: _load_variant(name) for name in VARIANTS}
    res["engine_rate_before"] = engine_rate_gflops(torch.get_num_threads())  # the tiles' rate this minute
    res.update(gemm_rates(ops, rounds=2 if quick else 4, repeats=2 if quick else 4))
    # the heap frozen after the load, as `serve`'s worker process does
    workers = frozen_after(lambda: {name: _worker(name) for name in VARIANTS})()
    any_worker = workers[VARIANTS[0]]
    for length in (256,) if quick else (256, 1024):
        seconds = prefill_seconds(workers, length, rounds=1 if quick else 3)
        shapes = layer_shapes(any_worker, lm_head=False)  # a prefill runs the LM head on 1 row
        onednn = packed_gemm_gflops(shapes, "bfloat16", length, repeats=2)
        flops = 2 * length * sum(n * k for n, k in shapes)
        for name, sec in seconds.items():
            res[f"prefill_{length}_{name}_tokens_per_s"] = length / sec
            res[f"prefill_{length}_{name}_fraction_of_onednn"] = flops / sec / (onednn * 1e9)
        res[f"prefill_{length}_onednn_linears_gflops"] = onednn
        res[f"prefill_{length}_speedup"] = seconds[VARIANTS[0]] / seconds[VARIANTS[1]]
    for batch in (1, 16) if quick else (1, 16, 64):
        seconds = decode_steps_lockstep(workers, steps=3 if quick else 8, batch=batch, prompt_len=128)
        shapes = layer_shapes(any_worker, lm_head=True)
        onednn = packed_gemm_gflops(shapes, "bfloat16", batch, repeats=2)
        streaming = streaming_gemm_gflops(shapes, "bfloat16", batch, repeats=2)
        flops = 2 * batch * sum(n * k for n, k in shapes)
        for name, sec in seconds.items():
            res[f"decode_b{batch}_{name}_tokens_per_s"] = batch / sec
            res[f"decode_b{batch}_{name}_fraction_of_onednn"] = flops / sec / (onednn * 1e9)
            res[f"decode_b{batch}_{name}_fraction_of_onednn_streaming"] = flops / sec / (streaming * 1e9)
        res[f"decode_b{batch}_onednn_linears_gflops"] = onednn
        res[f"decode_b{batch}_onednn_streaming_gflops"] = streaming
        res[f"decode_b{batch}_speedup"] = seconds[VARIANTS[0]] / seconds[VARIANTS[1]]
    res["loadavg_after"] = open("/proc/loadavg").read().split()[:3]
    res["engine_rate_after"] = engine_rate_gflops(torch.get_num_threads())
    return res


def main() -> None:
    suite_main(run, __doc__)


if __name__ == "__main__":
    main()
