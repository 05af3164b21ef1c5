"""Speculative decoding (issue 30): single-stream greedy decode tokens/s with n-gram
speculation / without, on the same worker and prompt, measured in the same run.

The real worker on the fast CPU forward (preset `qwen3-small-fp32` at bf16: hidden 512,
8 layers, vocab 32000, random weights) driven by `EngineCore` with 2 plans in flight (the
served default), prefix caching off. Each round runs the same request once plain and once
with `--speculative ngram` (k = 3, n-grams of 2..4), in turn; a ratio is the median over
rounds of (speculative tok/s / plain tok/s in that round). Decode time counts from the first
token to the last (the prefill is excluded).

- repetitive: a seed prompt of 32 random ids followed by the first 256 tokens of the model's
  own greedy answer to it; the answer's continuation repeats what that prompt holds. A
  random-weight model's greedy output drifts into short loops, which is where its copies come
  from: the acceptance measures the mechanism, not a language model's copying (no copying
  model was built). `*_acceptance` is accepted / proposed.
- non_repetitive: a prompt of 256 distinct random ids and the first 64 or 128 tokens of the
  answer, before it settles into loops: the lookup misses often (what the back-off is for).

Greedy tokens with and without speculation are compared every round: equal in fp32 (the
tests), while at bf16 a near-tie can flip (a verify's rows take the GEMM's multi-row tile, a
decode's the one-row path; measured: a top-2 gap of 8e-5 flipped on the non-repetitive prompt).

Run: `python -m bench.speculative [--quick]`.
"""

from __future__ import annotations

import random
import time

from base.plan import SamplingParams
from bench.common import median
from bench.suite_cli import suite_main
from control_plane.engine import EngineCore
from control_plane.scheduler_config import SchedulerConfig
from control_plane.speculation import SpeculativeConfig
from worker.worker import Worker
from worker.worker_config import WorkerConfig

MODEL = "random:qwen3-small-fp32"
PREFIX_TOKENS = 256
NGRAM = SpeculativeConfig("ngram", num_speculative_tokens=3, prompt_lookup_min=2, prompt_lookup_max=4)


def _worker() -> Worker:
    worker = Worker(WorkerConfig(model=MODEL, dtype="bfloat16", cpu_kernels="fast", max_model_len=2048))
    if worker.forward_kind != "cpu-fast":
        reason = worker.describe().forward_fallback_reason
        raise RuntimeError(f"the fast CPU forward is unavailable: {reason}")
    return worker


def _engine(worker: Worker, spec: bool) -> EngineCore:
    config = SchedulerConfig(
        max_num_seqs=4, enable_prefix_caching=False, speculative=NGRAM if spec else SpeculativeConfig()
    )
    return EngineCore(worker, config, plans_in_flight=2)


def decode(worker: Worker, prompt: list[int], max_tokens: int, spec: bool) -> tuple[float, list[int], object]:
    """(decode tokens/s after the first token, the tokens, the speculation counters)."""
    engine = _engine(worker, spec)
    engine.add_request("r", prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    tokens: list[int] = []
    started = None
    while engine.has_work():
        for out in engine.step():
            if out.new_token_ids and started is None:
                started, first = time.perf_counter(), len(out.new_token_ids) + len(tokens)
            tokens.extend(out.new_token_ids)
    elapsed = time.perf_counter() - started
    stats = engine.scheduler.speculator.stats if spec else None
    return (len(tokens) - first) / elapsed, tokens, stats


def run(quick: bool = False) -> dict:
    worker = _worker()
    vocab = worker.describe().vocab_size
    rng = random.Random(30)
    max_tokens = 64 if quick else 128
    rounds = 3 if quick else 7
    seed_prompt = [rng.randrange(vocab) for _ in range(32)]
    _, answer, _ = decode(worker, seed_prompt, PREFIX_TOKENS + max_tokens, False)
    workloads = {
        # the prompt holds the first PREFIX_TOKENS of the model's own answer: the rest repeats it
        "repetitive": seed_prompt + answer[:PREFIX_TOKENS],
        "non_repetitive": rng.sample(range(vocab), 256),
    }
    result: dict = {
        "model": MODEL,
        "dtype": "bfloat16",
        "max_tokens": max_tokens,
        "k": NGRAM.num_speculative_tokens,
    }
    for name, prompt in workloads.items():
        for spec in (False, True):  # warm-up (first touches, thread pool)
            decode(worker, prompt, max_tokens, spec)
        ratios, plain_rates, spec_rates = [], [], []
        stats, equal = None, 0
        for r in range(rounds):
            order = (False, True) if r % 2 == 0 else (True, False)
            rates, outputs = {}, {}
            for spec in order:
                rates[spec], outputs[spec], got = decode(worker, prompt, max_tokens, spec)
                stats = got if spec else stats
            # bf16: a verify's rows go through the GEMM's multi-row tiles, a decode's through
            # one row; the rounding differs and a near-tie (logit gap ~1e-4) can flip: counted.
            equal += outputs[True] == outputs[False]
            ratios.append(rates[True] / rates[False])
            plain_rates.append(rates[False])
            spec_rates.append(rates[True])
        result[f"{name}_plain_tok_s"] = median(plain_rates)
        result[f"{name}_spec_tok_s"] = median(spec_rates)
        result[f"{name}_speedup"] = median(ratios)
        result[f"{name}_acceptance"] = stats.acceptance_rate
        result[f"{name}_acceptance_per_position"] = stats.acceptance_per_position()
        result[f"{name}_mean_accepted_per_verify"] = stats.mean_accepted_length
        result[f"{name}_verifies"] = stats.num_verifies
        result[f"{name}_rounds_with_equal_tokens"] = f"{equal}/{rounds}"
    return result


if __name__ == "__main__":
    suite_main(run, __doc__)
