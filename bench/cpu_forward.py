"""CPU forward (issues 14, 25, 26): the fast CPU forward at the dtypes checkpoints ship in, as a
fraction of what this machine can do, measured in the same run.

Shapes (random weights): "small" = preset `qwen3-small-fp32` (hidden 512, 8 layers, 8/4 heads,
MLP 1536, vocab 32000; run at fp32 and at bf16), and in a full run "0.5b" = preset
`qwen2.5-0.5b` (hidden 896, 24 layers, 14/2 heads, MLP 4864, vocab 151936, tied; bf16 and fp32).

Quantized weights (issue 26), both shapes: the same random checkpoint's decoder linears written as
AutoAWQ GEMM int4 (group 128, asymmetric: Qwen3-8B-AWQ's format) and GPTQ int8 (group 128,
symmetric) by bench/quant_writer.py, served with the rest (embeddings, norms, tied lm_head) in
bf16, and (0.5b, full run) compressed-tensors W8A8 (int8 channel weights, int8 activations per
token); `awq-int4-lmh8` also holds that lm_head as int8 (`--lm-head-int8`, as llama.cpp's Q4_0 file
keeps it at Q8_0). Their packed-GEMM ceiling is the bf16 one of the same shapes (the dense GEMM
the quantized layers replace) and they have no ISA peak figure.

Per shape, every kind of weights (and, small shape, the dense reference forwards) stepped in
lock step so that background load hits all alike:
- decode step at batch 1, 16 and 64 (128-token prompts, then one token per sequence per step);
  prefill tokens/s of 8 x 256-token prompts in one step; the quantized kinds' speed-up over bf16
  is of steps taken in the same rounds;
- ceilings, each divided into the step it bounds:
  * packed GEMM: oneDNN's prepacked GEMM (the best GEMM torch has here) on the step's linear
    shapes at the step's rows; `fraction_of_packed_gemm` = that time / the whole step's time;
  * ISA peak: FMA (fp32), or for bf16 the matrix engine this CPU has (AMX tdpbf16ps, else
    vdpbf16ps) throughput of a register-only loop (`matrix_engine` names it);
  * prefill: the 8 x 256-token step's linears (LM head on its 8 sampling rows) at oneDNN's
    prepacked rate at 256 rows (AMX brgemm on an AMX CPU) / the step's time;
  * memory bandwidth (batch 1): weight bytes read per token / the machine's streaming-read rate,
    measured before and after the timings (it swings by tens of percent minute to minute);
- resident weight bytes of the fast forward vs the checkpoint's safetensors size.

Run: `python -m bench.cpu_forward [--quick]`.
"""

from __future__ import annotations

import random

import torch

from base.plan import SamplingParams
from bench.ceilings import (
    engine_peak_gflops,
    isa_peak_gflops,
    matrix_engine,
    memory_read_bandwidth_gbs,
    packed_gemm_gflops,
)
from bench.common import TimedWorker, engine_for, median
from bench.quant_writer import BENCH_QUANTS as QUANTIZED
from bench.quant_writer import bench_checkpoint
from bench.suite_cli import suite_main
from worker.default_model import ensure_random_model
from worker.worker import Worker
from worker.worker_config import WorkerConfig

MODELS = {"small": "random:qwen3-small-fp32", "0.5b": "random:qwen2.5-0.5b"}
PROMPT_LEN = 128


def _model(shape: str, weights: str) -> str:
    if weights not in QUANTIZED:
        return MODELS[shape]
    return str(bench_checkpoint(ensure_random_model(MODELS[shape].removeprefix("random:")), weights))


def _worker(shape: str, weights: str, kind: str) -> Worker:
    quantized = weights in QUANTIZED
    config = WorkerConfig(model=_model(shape, weights), dtype="bfloat16" if quantized else weights,
                          cpu_kernels=kind, kv_cache_memory=1 << 30, max_model_len=1024,
                          lm_head_int8=quantized and QUANTIZED[weights][1])  # fmt: skip
    worker = Worker(config)
    if kind == "fast" and worker.forward_kind != "cpu-fast":
        raise RuntimeError(
            f"the fast CPU forward is unavailable: {worker.describe().forward_fallback_reason}"
        )
    return worker


def decode_steps(workers: dict, batch: int, steps: int, prompt_len: int = PROMPT_LEN) -> dict:
    """Median decode step seconds per key of `workers`, every worker stepped in lock step."""
    vocab = next(iter(workers.values())).describe().vocab_size
    timed = {kind: TimedWorker(w) for kind, w in workers.items()}
    engines = {kind: engine_for(t, max_num_seqs=batch, caching=False) for kind, t in timed.items()}
    for engine in engines.values():
        rng = random.Random(batch)
        for i in range(batch):
            tokens = [rng.randrange(vocab) for _ in range(prompt_len)]
            engine.add_request(f"d{i}", tokens, SamplingParams(max_tokens=steps + 3, ignore_eos=True))
    for _ in range(steps + 3):
        for engine in engines.values():
            engine.step()
    result = {}
    for kind, t in timed.items():
        decodes = [s for n, k, s in t.samples if n == batch and k == batch][1:]  # first: warm-up
        result[kind] = median(decodes)
        engines[kind].run_to_completion()
    return result


def prefill_tokens_per_s(workers: dict, repeats: int) -> dict:
    vocab = next(iter(workers.values())).describe().vocab_size
    timed = {kind: TimedWorker(w) for kind, w in workers.items()}
    engines = {kind: engine_for(t, max_num_seqs=8, caching=False) for kind, t in timed.items()}
    for r in range(repeats + 1):
        for engine in engines.values():
            rng = random.Random(r)
            for i in range(8):
                tokens = [rng.randrange(vocab) for _ in range(256)]
                engine.add_request(f"p{r}-{i}", tokens, SamplingParams(max_tokens=1, ignore_eos=True))
            engine.step()
            engine.run_to_completion()
    tokens = 8 * 256
    return {
        kind: tokens / median([s for _, k, s in t.samples[1:] if k == tokens]) for kind, t in timed.items()
    }


def step_shapes(worker: Worker) -> list[tuple[int, int]]:
    """(N, K) of one decode step's linear layers as the fast forward runs them."""
    forward = worker.fast_forward
    shapes = [(forward.lm_head.out_features, forward.lm_head.in_features)]
    for layer in forward.layers:
        shapes += [
            (lin.out_features, lin.in_features)
            for lin in (layer.qkv, layer.o_proj, layer.gate_up, layer.down)
        ]
    return shapes


def checkpoint_bytes(worker: Worker) -> int:
    return sum(p.stat().st_size for p in worker.model_dir.glob("*.safetensors"))


def measure(shape: str, weights_list: list[str], quick: bool, peaks: dict, bandwidth: float) -> dict:
    """One shape with each kind of weights (a dtype or a QUANTIZED name), all stepped in lock step
    so that background load hits every kind alike: the figures listed in the module docstring,
    keyed `<shape>_<weights>_*`."""
    workers = {}
    for weights in weights_list:
        dense_small = shape == "small" and weights not in QUANTIZED
        for kind in ("fast", "reference") if dense_small else ("fast",):
            workers[(weights, kind)] = _worker(shape, weights, kind)
    res: dict = {}
    batches = (1, 64) if quick else (1, 16, 64)
    # --quick (CI's smoke run): 32-token contexts; the reference forwards' 64 x 128-token
    # prefill was most of the suite's time
    count, context = (3, 32) if quick else (16, PROMPT_LEN)
    steps = {batch: decode_steps(workers, batch, count, context) for batch in batches}
    prefill = prefill_tokens_per_s(workers, 1 if quick else 3)
    for weights in weights_list:
        fast, prefix = workers[(weights, "fast")], f"{shape}_{weights}"
        shapes = step_shapes(fast)
        resident = fast.fast_forward.resident_weight_bytes
        res[f"{prefix}_resident_weight_bytes"] = resident
        res[f"{prefix}_resident_over_checkpoint"] = (
            resident / checkpoint_bytes(fast) if weights != "float32" else None
        )
        dtype = "float32" if weights == "float32" else "bfloat16"  # of the packed-GEMM ceiling
        peak = None if weights in QUANTIZED else engine_peak_gflops(peaks, dtype)
        for batch in batches:
            mine = {kind: sec for (w, kind), sec in steps[batch].items() if w == weights}
            flops = sum(2 * batch * n * k for n, k in shapes)
            packed_s = flops / (packed_gemm_gflops(shapes, dtype, batch, repeats=2 if quick else 5) * 1e9)
            for kind, seconds in mine.items():
                res[f"{prefix}_decode_b{batch}_{kind}_step_ms"] = seconds * 1e3
                res[f"{prefix}_decode_b{batch}_{kind}_tokens_per_s"] = batch / seconds
            res[f"{prefix}_decode_b{batch}_packed_gemm_ms"] = packed_s * 1e3
            res[f"{prefix}_decode_b{batch}_fraction_of_packed_gemm"] = packed_s / mine["fast"]
            res[f"{prefix}_decode_b{batch}_fraction_of_isa_peak"] = (
                flops / mine["fast"] / (peak * 1e9) if peak else None
            )
            if batch == 1:
                res[f"{prefix}_decode_b1_weight_bytes_per_token"] = resident
                res[f"{prefix}_decode_b1_fraction_of_bandwidth"] = resident / mine["fast"] / (bandwidth * 1e9)
            if "reference" in mine:
                res[f"{prefix}_decode_b{batch}_speedup"] = mine["reference"] / mine["fast"]
            if weights in QUANTIZED and ("bfloat16", "fast") in workers:  # same steps, same rounds
                res[f"{prefix}_decode_b{batch}_speedup_over_bf16"] = (
                    steps[batch][("bfloat16", "fast")] / mine["fast"]
                )
        layers = shapes[1:]  # the LM head runs on the 8 sampling rows only
        prefill_flops = 2 * 256 * sum(n * k for n, k in layers) + 2 * 8 * shapes[0][0] * shapes[0][1]
        prefill_packed = packed_gemm_gflops(layers, dtype, 256, repeats=2 if quick else 5)
        for (w, kind), rate in prefill.items():
            if w == weights:
                res[f"{prefix}_prefill_8x256_{kind}_tokens_per_s"] = rate
                if kind == "fast":  # the step's GEMM seconds at oneDNN's rate / the step's seconds
                    step_s = 8 * 256 / rate
                    res[f"{prefix}_prefill_8x256_fraction_of_packed_gemm"] = (
                        prefill_flops / (prefill_packed * 1e9) / step_s
                    )
        if weights in QUANTIZED and ("bfloat16", "fast") in workers:
            bf16 = workers[("bfloat16", "fast")].fast_forward.resident_weight_bytes
            res[f"{prefix}_resident_over_bf16"] = resident / bf16
    return res


def run(quick: bool = False) -> dict:
    res: dict = {"threads": torch.get_num_threads()}
    peaks = isa_peak_gflops(res["threads"], iters=2_000_000 if quick else 20_000_000)
    res["isa_peak_fp32_gflops"], res["isa_peak_bf16_gflops"] = peaks["fp32"], peaks["bf16"]
    res["isa_peak_amx_bf16_gflops"], res["matrix_engine"] = peaks["amx_bf16"], matrix_engine()
    size = (256 if quick else 2048) << 20
    before = memory_read_bandwidth_gbs(res["threads"], size)
    cases = [("small", w) for w in ("float32", "bfloat16", "awq-int4", "gptq-int8")]
    if not quick:
        full = ("bfloat16", "float32", "awq-int4", "awq-int4-lmh8", "gptq-int8", "w8a8")
        cases += [("0.5b", w) for w in full]
    for shape in dict.fromkeys(shape for shape, _ in cases):
        res.update(measure(shape, [w for sh, w in cases if sh == shape], quick, peaks, before))
    after = memory_read_bandwidth_gbs(res["threads"], size)
    res["read_bandwidth_gbs_before"], res["read_bandwidth_gbs_after"] = before, after
    return res


def main() -> None:
    suite_main(run, __doc__)


if __name__ == "__main__":
    main()
