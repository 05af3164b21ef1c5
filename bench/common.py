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


def in_turn(keys, turn: int, alternate: bool = True) -> list:
    """`keys` in order, or (`alternate`, odd turns) reversed: A/B runs taking turns so that no
    side always runs right after the other."""
    keys = list(keys)
    return keys[::-1] if alternate and turn % 2 else keys


def decode_steps_lockstep(
    workers: dict, steps: int, warmup: int = 2, seed: int = 0, batch: int | None = None, prompt_len: int = 32
) -> dict:
    """`decode_step_seconds` for several workers at once, stepping their engines in turn so that
    a burst of background load on this shared machine lands on every one alike: the median of
    decode_step_samples' steps per worker."""
    samples = decode_step_samples(workers, steps, warmup, seed, batch, prompt_len)
    return {key: median(s) for key, s in samples.items()}


def decode_step_samples(
    workers: dict,
    steps: int,
    warmup: int = 2,
    seed: int = 0,
    batch: int | None = None,
    prompt_len: int = 32,
    alternate: bool = False,
) -> dict[object, list[float]]:
    """Seconds of `steps` full decode steps per worker (after `warmup`), the workers' engines
    stepped in turn (`alternate`: the order reversed every other turn, so that no worker always
    runs right after another), the i-th sample of each from the same turn. Keys are batch sizes
    (one worker per batch size: seq ids would collide in one), or, given `batch`, any labels of
    an A/B at one batch size. Prompts of `prompt_len` tokens (the context the decodes attend to)
    are prefilled first, in as many chunks as the token budget needs; only steps that decode every
    sequence count."""
    sizes = {key: batch or key for key in workers}
    timed = {key: TimedWorker(w) for key, w in workers.items()}
    engines = {}
    for key, t in timed.items():
        engines[key] = engine_for(t, max_num_seqs=sizes[key], caching=False)
        prefill_steps = -(-sizes[key] * prompt_len // 8192)  # engine_for's token budget
        # early prompts decode while later ones prefill: enough tokens to reach the full steps
        max_tokens = warmup + steps + 1 + prefill_steps
        add_requests(engines[key], random.Random(seed), sizes[key], prompt_len, max_tokens, f"d{key}")

    def full_decodes(key) -> list[float]:
        return [s for n, k, s in timed[key].samples if n == sizes[key] and k == sizes[key]]

    turn = 0
    while any(len(full_decodes(key)) < warmup + steps for key in engines):
        if not all(e.scheduler.has_pending_work() for e in engines.values()):
            raise AssertionError(f"the requests finished before {warmup + steps} full decode steps")
        for key in in_turn(engines, turn, alternate):
            engines[key].step()
        turn += 1
    result = {}
    for key, engine in engines.items():
        result[key] = full_decodes(key)[warmup : warmup + steps]
        engine.scheduler.abort_all()
        engine.run_to_completion()
    return result


def random_decode_layout(batch: int, context: int, block_size: int, gen):
    """(blocks, tables, seq_lens, query_start_loc) of `batch` decode rows at `context` keys each,
    their blocks (1.., block 0 unused) in a shuffled order over the pool: the input of the
    kernels' paged_attention for a decode step."""
    import torch

    per_row = -(-context // block_size)
    blocks = batch * per_row
    tables = (torch.randperm(blocks, generator=gen) + 1).to(torch.int32).view(batch, per_row).contiguous()
    lens = torch.full((batch,), context, dtype=torch.int32)
    return blocks, tables, lens, torch.arange(batch + 1, dtype=torch.int32)


def paged_decode_attention(ops, out, query, k, v, code: int, k_exps, v_exps, tables, lens, qsl) -> None:
    """One call of the kernels' paged_attention (kernels/cpu_attention.c) over decode rows:
    query/out [rows, heads, dim], pools [blocks, block_size, kv_heads, dim] of dtype `code`
    (kernels.cpu_build.DTYPES / KV_CODE_DTYPES), scale dim ** -0.5, no window."""
    import torch

    heads, dim = query.shape[1:]
    block_size, kv_heads = k.shape[1:3]
    status = ops.paged_attention(
        out.data_ptr(), query.data_ptr(), k.data_ptr(), v.data_ptr(), code, k_exps.data_ptr(),
        v_exps.data_ptr(), 0.0, 0.0, tables.data_ptr(), tables.shape[1], lens.data_ptr(), qsl.data_ptr(),
        len(lens), heads, kv_heads, dim, block_size, dim**-0.5, 0, torch.get_num_threads(),
    )  # fmt: skip
    if status != 0:
        raise RuntimeError(f"paged_attention returned {status}")
