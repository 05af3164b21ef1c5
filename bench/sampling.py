"""Sampling and logprobs (issue 28): what logit shaping, per-token top logprobs and prompt
logprobs cost, as ratios to the same step without them, measured in the same run.

The real worker on the fast CPU forward (preset `qwen3-small-fp32` at bf16: hidden 512,
8 layers, vocab 32000, random weights), one worker and engine per variant (seq ids would
collide in one), caching off. Two times per step: the worker's execute alone, and the whole
`EngineCore.step` (schedule + execute + the control plane's update, where logprobs become
outputs: what a user sees). Variants are stepped in turn, the order rotated each round, and a
ratio is the median over rounds of (variant / reference in that round): a burst of background
load on this shared machine spans a round or lands on one step, an outlier the median drops.
`*_step_ratio` is of the whole step, `*_worker_ratio` of the worker alone; `*_ms` are medians.

- decode at batch 64 (128-token random prompts, then one token per sequence per step):
  * plain: temperature 0.8, a seed per request; the reference of the ratios below;
  * penalties: + repetition_penalty 1.1, presence_penalty 0.5, frequency_penalty 0.5;
  * all_shaping: penalties + min_p 0.05 + a logit_bias on 4 ids;
  * top20_logprobs: plain + logprobs=True, top_logprobs=20 (every token);
  * greedy, greedy_penalties: temperature 0 without and with the penalties (ratio to greedy);
- prefill of a 1024-token prompt (max_tokens 1): a plain request, one asking prompt_logprobs=5
  and one asking 0, on the same prompt each round; ratio of the prefill step's times. Each
  prompt row then goes through the lm_head (32000 x 512), which no implementation avoids:
  `*_lm_head_floor` = (plain prefill + the lm_head alone over the prompt's rows, in the
  worker's slices, timed in the same rounds) / plain prefill, the least the ratio can be.

Quick mode: batch 8 and a 128-token prompt, a few rounds (keys are named by those sizes).
Run: `python -m bench.sampling [--quick]`.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable

import torch

from base.plan import SamplingParams
from bench.common import TimedWorker, engine_for, median
from bench.suite_cli import suite_main
from worker.prompt_logprobs import ROWS_PER_SLICE
from worker.worker import Worker
from worker.worker_config import WorkerConfig

MODEL = "random:qwen3-small-fp32"
DECODE_PROMPT_LEN = 128
TEMPERATURE = 0.8
PENALTIES = {"repetition_penalty": 1.1, "presence_penalty": 0.5, "frequency_penalty": 0.5}
LOGIT_BIAS = ((7, 2.0), (42, -5.0), (1000, 1.5), (20000, -100.0))  # sorted by id, as validate wants
ALL_SHAPING = {**PENALTIES, "min_p": 0.05, "logit_bias": LOGIT_BIAS}
DECODE_VARIANTS = {  # name -> (sampling fields, the variant it is compared to)
    "plain": ({"temperature": TEMPERATURE}, None),
    "penalties": ({"temperature": TEMPERATURE, **PENALTIES}, "plain"),
    "all_shaping": ({"temperature": TEMPERATURE, **ALL_SHAPING}, "plain"),
    "top20_logprobs": ({"temperature": TEMPERATURE, "logprobs": True, "top_logprobs": 20}, "plain"),
    "greedy": ({"temperature": 0.0}, None),
    "greedy_penalties": ({"temperature": 0.0, **PENALTIES}, "greedy"),
}  # fmt: skip
PREFILL_VARIANTS = {"plain": None, "k5": 5, "k0": 0}  # prompt_logprobs

Rounds = dict[str, list[tuple[float, float]]]  # variant -> (whole step s, worker s) per round


def _worker(max_model_len: int) -> Worker:
    config = WorkerConfig(model=MODEL, dtype="bfloat16", cpu_kernels="fast", kv_cache_memory=256 << 20,
                          max_model_len=max_model_len)  # fmt: skip
    worker = Worker(config)
    if worker.forward_kind != "cpu-fast":
        raise RuntimeError(
            f"the fast CPU forward is unavailable: {worker.describe().forward_fallback_reason}"
        )
    return worker


def _timed_step(engine, timed: TimedWorker) -> tuple[float, tuple[int, int, float] | None]:
    """Whole engine step seconds, and the worker sample it made (None: the worker was not called)."""
    before = len(timed.samples)
    started = time.perf_counter()
    engine.step()
    elapsed = time.perf_counter() - started
    return elapsed, timed.samples[-1] if len(timed.samples) > before else None


def _rotated(names: list[str], r: int) -> list[str]:
    return names[r % len(names) :] + names[: r % len(names)]


def decode_rounds(batch: int, steps: int, warmup: int = 2) -> Rounds:
    """(whole step, worker) seconds of a full decode step per variant and measured round."""
    timed = {name: TimedWorker(_worker(DECODE_PROMPT_LEN + steps + warmup + 8)) for name in DECODE_VARIANTS}
    engines = {name: engine_for(t, max_num_seqs=batch, caching=False) for name, t in timed.items()}
    vocab = next(iter(timed.values())).describe().vocab_size
    for name, engine in engines.items():
        rng = random.Random(batch)  # the same prompts for every variant
        fields = DECODE_VARIANTS[name][0]
        for i in range(batch):
            tokens = [rng.randrange(vocab) for _ in range(DECODE_PROMPT_LEN)]
            seed = i if fields["temperature"] > 0 else None
            sampling = SamplingParams(max_tokens=steps + warmup + 1, ignore_eos=True, seed=seed, **fields)
            engine.add_request(f"d{i}", tokens, sampling)
        engine.step()  # every prefill in one step (the token budget covers them)
    rounds: Rounds = {name: [] for name in engines}
    for r in range(warmup + steps):
        for name in _rotated(list(engines), r):
            whole, sample = _timed_step(engines[name], timed[name])
            if sample is None or sample[:2] != (batch, batch):
                raise AssertionError(f"{name}: expected a decode step of {batch} sequences, got {sample}")
            if r >= warmup:
                rounds[name].append((whole, sample[2]))
    for engine in engines.values():
        engine.run_to_completion()
    return rounds


def _lm_head_seconds(worker: Worker, rows: int) -> Callable[[], float]:
    """Times the lm_head alone over `rows` fp32 hidden rows, in the slices prompt logprobs use."""
    forward = worker.fast_forward
    hidden = torch.randn(rows, forward.lm_head.in_features)

    def once() -> float:
        started = time.perf_counter()
        with torch.inference_mode():
            for begin in range(0, rows, ROWS_PER_SLICE):
                forward.compute_logits(hidden[begin : begin + ROWS_PER_SLICE])
        return time.perf_counter() - started

    return once


def prefill_rounds(prompt_len: int, repeats: int) -> Rounds:
    """(whole step, worker) seconds of one prompt's prefill per prompt_logprobs setting and
    round, plus "lm_head": the lm_head alone over the prompt's rows (both fields)."""
    timed = {name: TimedWorker(_worker(prompt_len + 8)) for name in PREFILL_VARIANTS}
    budget = max(8192, prompt_len)  # the whole prompt in one step
    engines = {name: engine_for(t, max_num_seqs=4, caching=False, budget=budget) for name, t in timed.items()}
    lm_head = _lm_head_seconds(timed["plain"].worker, prompt_len - 1)
    vocab = next(iter(timed.values())).describe().vocab_size
    rounds: Rounds = {name: [] for name in [*engines, "lm_head"]}
    for r in range(repeats + 1):  # round 0: warm-up
        rng = random.Random(r)
        tokens = [rng.randrange(vocab) for _ in range(prompt_len)]
        for name in _rotated(list(rounds), r):
            if name == "lm_head":
                seconds = lm_head()
                whole, sample = seconds, (1, prompt_len, seconds)
            else:
                sampling = SamplingParams(
                    max_tokens=1, ignore_eos=True, prompt_logprobs=PREFILL_VARIANTS[name]
                )
                engines[name].add_request(f"p{r}", tokens, sampling)
                whole, sample = _timed_step(engines[name], timed[name])
                engines[name].run_to_completion()
            if sample is None or sample[1] != prompt_len:
                raise AssertionError(
                    f"{name}: expected the {prompt_len}-token prompt in one step, got {sample}"
                )
            if r:
                rounds[name].append((whole, sample[2]))
    return rounds


def _ratio(rounds: Rounds, name: str, base: str, field: int) -> float:
    return median([v[field] / b[field] for v, b in zip(rounds[name], rounds[base], strict=True)])


def run(quick: bool = False) -> dict:
    batch, prompt_len = (8, 128) if quick else (64, 1024)
    res: dict = {"batch": batch, "prefill_prompt_len": prompt_len}
    decode = decode_rounds(batch, 4 if quick else 60)
    for name, rounds in decode.items():
        res[f"b{batch}_{name}_step_ms"] = median([w for w, _ in rounds]) * 1e3
        res[f"b{batch}_{name}_worker_ms"] = median([x for _, x in rounds]) * 1e3
    for name, (_, base) in DECODE_VARIANTS.items():
        if base is not None:
            res[f"b{batch}_{name}_step_ratio"] = _ratio(decode, name, base, 0)
            res[f"b{batch}_{name}_worker_ratio"] = _ratio(decode, name, base, 1)
    label = "1k" if prompt_len == 1024 else str(prompt_len)
    prefill = prefill_rounds(prompt_len, 2 if quick else 15)
    for name in PREFILL_VARIANTS:
        rounds = prefill[name]
        res[f"prompt_logprobs_{label}_{name}_prefill_step_ms"] = median([w for w, _ in rounds]) * 1e3
        res[f"prompt_logprobs_{label}_{name}_prefill_worker_ms"] = median([x for _, x in rounds]) * 1e3
    for name in ("k5", "k0"):
        suffix = "" if name == "k5" else "_k0"  # the goal's key: the costlier k = 5
        res[f"prompt_logprobs_{label}{suffix}_prefill_ratio"] = _ratio(prefill, name, "plain", 0)
        res[f"prompt_logprobs_{label}{suffix}_prefill_worker_ratio"] = _ratio(prefill, name, "plain", 1)
    plain = prefill["plain"]
    res[f"prompt_logprobs_{label}_lm_head_ms"] = median([h for h, _ in prefill["lm_head"]]) * 1e3
    res[f"prompt_logprobs_{label}_lm_head_floor"] = median(
        [1 + h / p for (h, _), (p, _) in zip(prefill["lm_head"], plain, strict=True)]
    )
    return res


def main() -> None:
    suite_main(run, __doc__)


if __name__ == "__main__":
    main()
