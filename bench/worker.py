"""Worker (issue 3): the embedded default model on the CPU backend, driven by plans from the
real scheduler; only `Worker.execute` is timed (medians after warm-up).

- decode tokens/s at batch 1, 8, 32 (one token per sequence per step; the three batch sizes
  step in turn on three workers, so background load hits them alike);
- prefill tokens/s of one 512-token prompt (prefix caching off, a fresh prompt each repeat);
- paged vs contiguous KV (`kv_layout="contiguous"`): the same greedy workload on two workers
  of equal KV budget, run in lock step (one engine step on each in turn, alternating which
  goes first); ratio = paged / contiguous worker time, median over runs, and the median of
  the per-step ratios of the decode steps.

Run: `python -m bench.worker [--quick]`.
"""

from __future__ import annotations

import random

from base.plan import SamplingParams
from bench.common import (
    TimedWorker,
    add_requests,
    decode_steps_lockstep,
    engine_for,
    median,
    prompt,
)
from bench.suite_cli import suite_main
from worker.worker import Worker
from worker.worker_config import WorkerConfig

DECODE_BATCHES = (1, 8, 32)
LAYOUT_MAX_MODEL_LEN = 1024  # bounds the contiguous rows; both layouts use it
LAYOUT_KV_BYTES = 64 << 20  # 16 contiguous rows of 1024 tokens; the same budget for paged
DECODE_KV_BYTES = 32 << 20  # 512 blocks: ample for 32 short sequences, small x 3 workers


def bench_decode(steps: int) -> dict:
    workers = {batch: Worker(WorkerConfig(kv_cache_memory=DECODE_KV_BYTES)) for batch in DECODE_BATCHES}
    res = {}
    for batch, seconds in decode_steps_lockstep(workers, steps).items():
        res[f"decode_b{batch}_step_ms"] = seconds * 1e3
        res[f"decode_b{batch}_tokens_per_s"] = batch / seconds
    return res


def bench_prefill(worker: Worker, prompt_len: int, repeats: int) -> dict:
    timed = TimedWorker(worker)
    engine = engine_for(timed, max_num_seqs=1, caching=False, budget=prompt_len)
    rng = random.Random(1)
    for i in range(repeats + 1):  # the first is warm-up
        engine.add_request(f"p{i}", prompt(rng, prompt_len), SamplingParams(max_tokens=1, ignore_eos=True))
        engine.run_to_completion()
    seconds = median([s for _, t, s in timed.samples[1:] if t == prompt_len])
    return {
        "prefill_prompt_tokens": prompt_len,
        "prefill_ms": seconds * 1e3,
        "prefill_tokens_per_s": prompt_len / seconds,
    }


def _lockstep_run(workers: dict[str, Worker], num_reqs: int, prompt_len: int, max_tokens: int, first: str):
    """The comparison workload on every worker at once, one engine step each in turn, so that
    step i of each layout runs under the same background load (this machine is shared).
    Both schedulers see the same requests and make the same plans step for step."""
    timed = {name: TimedWorker(w) for name, w in workers.items()}
    engines = {name: engine_for(t, max_num_seqs=num_reqs, caching=False) for name, t in timed.items()}
    for engine in engines.values():
        add_requests(engine, random.Random(7), num_reqs, prompt_len, max_tokens, tag="layout")
    order = [first, *(n for n in engines if n != first)]
    tokens: dict[str, dict] = {name: {} for name in engines}
    while any(e.scheduler.has_pending_work() for e in engines.values()):
        for name in order:
            for out in engines[name].step():
                tokens[name].setdefault(out.request_id, []).extend(out.new_token_ids)
    return timed, tokens


def bench_paged_vs_contiguous(repeats: int, num_reqs: int, prompt_len: int, max_tokens: int) -> dict:
    workers = {
        layout: Worker(
            WorkerConfig(
                kv_layout=layout, max_model_len=LAYOUT_MAX_MODEL_LEN, kv_cache_memory=LAYOUT_KV_BYTES
            )
        )
        for layout in ("paged", "contiguous")
    }
    _lockstep_run(workers, num_reqs, prompt_len, max_tokens, "paged")  # warm-up, not recorded
    total_ratios, step_ratios, totals = [], [], {"paged": [], "contiguous": []}
    same_tokens = True
    for r in range(repeats):
        first = "paged" if r % 2 == 0 else "contiguous"
        timed, tokens = _lockstep_run(workers, num_reqs, prompt_len, max_tokens, first)
        paged, contiguous = timed["paged"].samples, timed["contiguous"].samples
        if [s[:2] for s in paged] != [s[:2] for s in contiguous]:
            raise AssertionError("the two layouts were given different steps")
        for name in totals:
            totals[name].append(timed[name].total_seconds())
        total_ratios.append(totals["paged"][-1] / totals["contiguous"][-1])
        step_ratios += [p[2] / c[2] for p, c in zip(paged, contiguous, strict=True) if p[0] == p[1]]
        same_tokens = same_tokens and tokens["paged"] == tokens["contiguous"]
    return {
        "layout_workload": f"{num_reqs} x ({prompt_len} prompt + {max_tokens} greedy), {repeats} runs each",
        "layout_paged_worker_s": median(totals["paged"]),
        "layout_contiguous_worker_s": median(totals["contiguous"]),
        "paged_vs_contiguous_ratio": median(total_ratios),
        "paged_vs_contiguous_decode_step_ratio": median(step_ratios),
        "layout_same_tokens": same_tokens,
    }


def run(quick: bool = False) -> dict:
    worker = Worker(WorkerConfig())
    res = {"model": worker.describe().model_name, "device": worker.describe().device}
    res.update(bench_decode(steps=5 if quick else 30))
    res.update(bench_prefill(worker, 256 if quick else 512, repeats=3 if quick else 7))
    del worker
    if quick:
        res.update(bench_paged_vs_contiguous(repeats=2, num_reqs=4, prompt_len=64, max_tokens=8))
    else:
        res.update(bench_paged_vs_contiguous(repeats=10, num_reqs=8, prompt_len=128, max_tokens=32))
    return res


def main() -> None:
    suite_main(run, __doc__)


if __name__ == "__main__":
    main()
