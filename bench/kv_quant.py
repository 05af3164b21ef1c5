"""Quantized KV cache (issue 31) on the fast CPU forward: decode step time with an fp8 / int8 KV
cache vs a bf16 one, and the accuracy cost, on the same bf16 model in the same run.

Model: the default model (4 layers, hidden 256, 8 query / 2 KV heads of dim 64) at bf16: small
enough that attention over a long context is most of a decode step, which is where a 1-byte
cache could cost time (decoding codes, one scale per key and head). Each KV dtype gets its
own worker; all are stepped in lock step (background load hits all alike).

- decode step at batch 64 (full run; 16 quick) with every sequence at CONTEXT tokens (2048 full,
  256 quick), median over the steps after a warm-up; ratio = quantized / bf16 (goal <= 1.05);
- the attention kernel alone (kernels/cpu_attention.c paged_attention, the same batch and
  context, the default model's heads, pools of each dtype filled with random K/V), the three
  interleaved, median over rounds: the step figure minus everything that is not attention;
- accuracy on one fixed random token stream, teacher-forced (prefill of the stream, one
  decode step per position): perplexity of the stream under each cache, top-1 agreement with
  and max logit error against the bf16 cache's logits.

Run: `python -m bench.kv_quant [--quick]`.
"""

from __future__ import annotations

import random
import time

import torch

from base.plan import ContinuingSequence, NewSequence, Plan, SamplingParams
from bench.common import decode_steps_lockstep, median, paged_decode_attention, random_decode_layout
from bench.suite_cli import suite_main
from worker.worker import Worker
from worker.worker_config import WorkerConfig

KV_DTYPES = ("auto", "fp8_e4m3", "int8")  # fp8_e5m2 decodes like fp8_e4m3 (one shift less)


def _worker(kv_cache_dtype: str, max_model_len: int, batch: int) -> Worker:
    """A bf16 default-model worker whose pool holds `batch` sequences of max_model_len in bf16."""
    memory = batch * max_model_len * 2048 + (16 << 20)  # 2 KiB per token at bf16 (4 x 2 x 2 x 64 x 2)
    config = WorkerConfig(dtype="bfloat16", kv_cache_dtype=kv_cache_dtype, kv_cache_memory=memory,
                          max_model_len=max_model_len, cpu_kernels="fast")  # fmt: skip
    return Worker(config)


def attention_seconds(batch: int, context: int, rounds: int, block_size: int = 16) -> dict:
    """Median seconds of one decode attention call over bf16 / quantized pools (interleaved)."""
    from kernels.cpu_build import DTYPES, load_cpu_ops
    from worker.kv_quant import FORMATS, quantize

    ops, heads, kv_heads, dim = load_cpu_ops(), 8, 2, 64
    gen = torch.Generator().manual_seed(0)
    blocks, tables, lens, qsl = random_decode_layout(batch, context, block_size, gen)
    k, v = (torch.randn(blocks + 1, block_size, kv_heads, dim, generator=gen) for _ in range(2))
    query = torch.randn(batch, heads, dim, generator=gen)
    out, none = torch.empty_like(query), torch.zeros(1, dtype=torch.uint8)
    pools = {"auto": (DTYPES["bfloat16"], k.bfloat16(), v.bfloat16(), none, none)}
    for kind in KV_DTYPES[1:]:
        (kc, kb), (vc, vb) = quantize(k, FORMATS[kind]), quantize(v, FORMATS[kind])
        pools[kind] = (FORMATS[kind].code, kc, vc, kb, vb)
    samples: dict = {kind: [] for kind in pools}
    for _ in range(rounds + 1):  # the first round: warm-up
        for kind, (code, kp, vp, kb, vb) in pools.items():
            started = time.perf_counter()
            paged_decode_attention(ops, out, query, kp, vp, code, kb, vb, tables, lens, qsl)
            samples[kind].append(time.perf_counter() - started)
    return {kind: median(s[1:]) for kind, s in samples.items()}


def teacher_forced_logits(worker: Worker, stream: list[int]) -> torch.Tensor:
    """[len - 1, vocab]: logits predicting stream[p + 1] from stream[: p + 1], one decode step
    per position (the decode path is what serving runs), from hand-made plans."""
    block_size, greedy = worker.describe().block_size, SamplingParams(temperature=0.0)
    table, rows = [], []
    for p in range(len(stream) - 1):
        new_blocks = [len(table) + 1] if p % block_size == 0 else []
        table += new_blocks
        if p == 0:
            plan = Plan(step_id=p, new=[NewSequence(1, list(table), [stream[0]], 0, greedy, True)])
        else:
            plan = Plan(step_id=p, continuing=[ContinuingSequence(1, new_blocks, [], [stream[p]], p, True)])
        rows.append(worker.execute_with_logits(plan)[1][0])
    worker.execute(Plan(step_id=len(stream), finished=[1]))
    return torch.stack(rows)


def accuracy(workers: dict, length: int) -> dict:
    vocab = next(iter(workers.values())).describe().vocab_size
    rng = random.Random(31)
    stream = [rng.randrange(vocab) for _ in range(length)]
    targets = torch.tensor(stream[1:])
    logits = {kind: teacher_forced_logits(w, stream) for kind, w in workers.items()}
    base = logits["auto"]
    res = {}
    for kind, lg in logits.items():
        nll = torch.nn.functional.cross_entropy(lg, targets).item()
        res[f"{kind}_perplexity"] = float(torch.tensor(nll).exp())
        if kind != "auto":
            res[f"{kind}_top1_agreement_vs_bf16"] = (lg.argmax(-1) == base.argmax(-1)).float().mean().item()
            res[f"{kind}_max_logit_error_vs_bf16"] = ((lg - base).abs().max() / base.abs().max()).item()
    return res


def run(quick: bool = False) -> dict:
    batch, context, steps = (16, 256, 4) if quick else (64, 2048, 9)
    workers = {kind: _worker(kind, context + 64, batch) for kind in KV_DTYPES}
    times = decode_steps_lockstep(workers, steps, warmup=1, batch=batch, prompt_len=context)
    res = {"batch": batch, "context": context, "bf16_decode_step_ms": times["auto"] * 1e3}
    for kind in KV_DTYPES[1:]:
        res[f"{kind}_decode_step_ms"] = times[kind] * 1e3
        res[f"{kind}_decode_step_vs_bf16"] = times[kind] / times["auto"]
    attention = attention_seconds(batch, context, 5 if quick else 15)
    res["bf16_attention_ms"] = attention["auto"] * 1e3
    for kind in KV_DTYPES[1:]:
        res[f"{kind}_attention_ms"] = attention[kind] * 1e3
        res[f"{kind}_attention_vs_bf16"] = attention[kind] / attention["auto"]
    for w in workers.values():
        w.reset()
    res.update(accuracy(workers, 128 if quick else 1024))
    return res


def main() -> None:
    suite_main(run, __doc__)


if __name__ == "__main__":
    main()
