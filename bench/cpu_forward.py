"""CPU forward (issue 14): the fast CPU forward against the reference forward and against the
machine's GEMM ceiling, on the Qwen3 geometry of the vLLM comparison (random weights, preset
`qwen3-small-fp32`: hidden 512, 8 layers, 8/4 heads, head_dim 64, MLP 1536, vocab 32000, fp32).

- decode step at batch 1 and 64 (128-token prompts, then one token per sequence per step) and
  prefill tokens/s of 8 x 256-token prompts in one step, for `--cpu-kernels fast` and
  `reference`, run in lock step (one step each in turn) so background load hits both alike;
- the GEMM ceiling at each batch: the step's linear layers (q|k|v, o, gate|up, down per layer,
  lm_head for the sampling rows) timed alone, as plain `torch.mm` (the issue's definition) and
  as the best library call the fast forward uses (oneDNN packed / C GEMV at one row);
  achieved fraction = ceiling time / measured step time (1.0 = the step is nothing but GEMMs
  at that speed; above 1 against plain mm means faster GEMMs than torch's default).

Run: `python -m bench.cpu_forward [--quick]`.
"""

from __future__ import annotations

import random
import time

import torch

from base.plan import SamplingParams
from bench.common import TimedWorker, engine_for, median
from bench.suite_cli import suite_main
from worker.cpu_forward import PackedLinear
from worker.worker import Worker
from worker.worker_config import WorkerConfig

MODEL = "random:qwen3-small-fp32"
KINDS = ("fast", "reference")
PROMPT_LEN = 128


def _workers() -> dict[str, Worker]:
    config = dict(model=MODEL, kv_cache_memory=1 << 30, max_model_len=1024)
    return {kind: Worker(WorkerConfig(**config, cpu_kernels=kind)) for kind in KINDS}


def decode_steps(workers: dict[str, Worker], batch: int, steps: int) -> dict[str, float]:
    """Median decode step seconds per forward kind, stepped in lock step."""
    timed = {kind: TimedWorker(w) for kind, w in workers.items()}
    engines = {kind: engine_for(t, max_num_seqs=batch, caching=False) for kind, t in timed.items()}
    for engine in engines.values():
        rng = random.Random(batch)
        for i in range(batch):
            tokens = [rng.randrange(32000) for _ in range(PROMPT_LEN)]
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


def prefill_tokens_per_s(workers: dict[str, Worker], repeats: int) -> dict[str, float]:
    timed = {kind: TimedWorker(w) for kind, w in workers.items()}
    engines = {kind: engine_for(t, max_num_seqs=8, caching=False) for kind, t in timed.items()}
    for r in range(repeats + 1):
        for engine in engines.values():
            rng = random.Random(r)
            for i in range(8):
                tokens = [rng.randrange(32000) for _ in range(256)]
                engine.add_request(f"p{r}-{i}", tokens, SamplingParams(max_tokens=1, ignore_eos=True))
            engine.step()
            engine.run_to_completion()
    tokens = 8 * 256
    return {
        kind: tokens / median([s for _, k, s in t.samples[1:] if k == tokens]) for kind, t in timed.items()
    }


def _seconds(fn, repeats: int) -> float:
    fn()
    started = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - started) / repeats


def gemm_ceiling(worker: Worker, batch: int, repeats: int) -> dict[str, float]:
    """Seconds of one decode step's GEMMs alone at `batch` rows, plain torch.mm and the fast
    forward's own calls, plus the FLOPs they do."""
    forward = worker.fast_forward
    linears: list[PackedLinear] = [forward.lm_head]
    for layer in forward.layers:
        linears += [layer.qkv, layer.o_proj, layer.gate_up, layer.down]
    plain, fast, flops = 0.0, 0.0, 0
    with torch.inference_mode():
        for linear in linears:
            x = torch.randn(batch, linear.in_features)
            weight_t = linear.plain.t()
            plain += _seconds(lambda x=x, w=weight_t: torch.mm(x, w), repeats)
            fast += _seconds(lambda x=x, lin=linear: lin(x), repeats)
            flops += 2 * batch * linear.in_features * linear.out_features
    return {"plain_mm_s": plain, "fast_s": fast, "flops": flops}


def run(quick: bool = False) -> dict:
    torch.set_num_threads(torch.get_num_threads())
    workers = _workers()
    if workers["fast"].forward_kind != "cpu-fast":
        raise RuntimeError("the fast CPU forward is unavailable here (see the worker's warning)")
    res: dict = {"model": MODEL, "threads": torch.get_num_threads()}
    for batch in (1, 64):
        steps = decode_steps(workers, batch, 5 if quick else 20)
        ceiling = gemm_ceiling(workers["fast"], batch, 3 if quick else 10)
        for kind, seconds in steps.items():
            res[f"decode_b{batch}_{kind}_step_ms"] = seconds * 1e3
            res[f"decode_b{batch}_{kind}_tokens_per_s"] = batch / seconds
        res[f"decode_b{batch}_speedup"] = steps["reference"] / steps["fast"]
        res[f"gemm_b{batch}_plain_mm_ms"] = ceiling["plain_mm_s"] * 1e3
        res[f"gemm_b{batch}_plain_mm_gflops"] = ceiling["flops"] / ceiling["plain_mm_s"] / 1e9
        res[f"gemm_b{batch}_fast_ms"] = ceiling["fast_s"] * 1e3
        res[f"gemm_b{batch}_fast_gflops"] = ceiling["flops"] / ceiling["fast_s"] / 1e9
        res[f"decode_b{batch}_fraction_of_plain_mm_ceiling"] = ceiling["plain_mm_s"] / steps["fast"]
        res[f"decode_b{batch}_fraction_of_fast_gemm_ceiling"] = ceiling["fast_s"] / steps["fast"]
    prefill = prefill_tokens_per_s(workers, 1 if quick else 4)
    for kind, rate in prefill.items():
        res[f"prefill_8x256_{kind}_tokens_per_s"] = rate
    res["prefill_speedup"] = prefill["fast"] / prefill["reference"]
    return res


def main() -> None:
    suite_main(run, __doc__)


if __name__ == "__main__":
    main()
