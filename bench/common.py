"""Helpers shared by the worker-side benchmarks: percentiles, a timing proxy around a worker,
and a seeded prompt generator for the embedded default model (byte ids 0-255)."""

from __future__ import annotations

import math
import random
import statistics
import time

from base.plan import Plan, SamplingParams, StepResult, WorkerInfo
from control_plane.engine import EngineCore
from control_plane.scheduler_config import SchedulerConfig

BYTE_VOCAB = 256  # the default model's byte tokenizer: ids below 256 are plain bytes


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (q in [0, 100]) of a non-empty list."""
    if not values:
        raise ValueError("percentile of an empty list")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def median(values: list[float]) -> float:
    return statistics.median(values)


def prompt(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(BYTE_VOCAB) for _ in range(length)]


class TimedWorker:
    """Forwards to a worker and records the wall time and token count of every execute(),
    so a benchmark can time the worker alone while the real scheduler makes the plans."""

    def __init__(self, worker) -> None:
        self.worker = worker
        self.samples: list[tuple[int, int, float]] = []  # (num sequences, num tokens, seconds)

    def describe(self) -> WorkerInfo:
        return self.worker.describe()

    def reset(self) -> None:
        self.worker.reset()

    def execute(self, plan: Plan) -> StepResult:
        started = time.perf_counter()
        result = self.worker.execute(plan)
        elapsed = time.perf_counter() - started
        self.samples.append((len(plan.new) + len(plan.continuing), plan.num_tokens, elapsed))
        return result

    def total_seconds(self) -> float:
        return sum(s for _, _, s in self.samples)


def engine_for(worker, max_num_seqs: int, caching: bool = True, budget: int = 8192) -> EngineCore:
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, enable_prefix_caching=caching
    )
    return EngineCore(worker, config)


def add_requests(
    engine: EngineCore, rng: random.Random, count: int, prompt_len: int, max_tokens: int, tag: str
) -> None:
    sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    for i in range(count):
        engine.add_request(f"{tag}-{i}", prompt(rng, prompt_len), sampling)


def decode_step_seconds(worker, batch: int, steps: int, warmup: int = 2, seed: int = 0) -> float:
    """Median worker time of one decode step with `batch` running sequences (prompts of 32
    tokens, prefilled first; scheduler-made plans; only the worker's execute is timed)."""
    return decode_steps_lockstep({batch: worker}, steps, warmup, seed)[batch]


def decode_steps_lockstep(workers: dict[int, object], steps: int, warmup: int = 2, seed: int = 0) -> dict:
    """`decode_step_seconds` for several batch sizes at once, one worker per batch size (seq
    ids would collide in one), stepping the engines in turn so that a burst of background
    load on this shared machine lands on every batch size alike, not on one of them."""
    timed = {batch: TimedWorker(w) for batch, w in workers.items()}
    engines = {}
    for batch, t in timed.items():
        engines[batch] = engine_for(t, max_num_seqs=batch, caching=False)
        add_requests(engines[batch], random.Random(seed), batch, 32, warmup + steps + 1, f"d{batch}")
        engines[batch].step()  # the prefill of every prompt (the token budget covers them all)
        t.samples.clear()
    while any(e.scheduler.has_pending_work() for e in engines.values()):
        for engine in engines.values():
            engine.step()
    result = {}
    for batch, t in timed.items():
        decodes = [s for n, k, s in t.samples if n == batch and k == batch]
        if len(decodes) < warmup + steps:
            raise AssertionError(f"expected {warmup + steps} full decode steps, saw {len(decodes)}")
        result[batch] = median(decodes[warmup : warmup + steps])
    return result
