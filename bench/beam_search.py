"""Beam search (issue 16): KV memory saved by sharing blocks between beams, and throughput
against running the same number of independent greedy requests, on the default model.

Workload (a long prompt and 64-256 output tokens, as in the vLLM paper's beam-search
experiment, SOSP '23 section 6.3): a 512-token random byte prompt (and a 32-token one, where
most of what beams share is their own common output prefix), widths 2, 4 and 8,
ignore_eos (so every beam runs to max_tokens and the early-stop heuristic cannot end it),
block size 16, prefix caching on, in-process `EngineCore` + `Worker`.

Memory, measured on the run itself after every step: `shared` = KV blocks in use (beams
share the prompt's and their common prefix's blocks, copy-on-write of a shared last block);
`private` = the blocks the same live beams would hold if each kept a private copy of its
table (the sum of their table lengths: what a design without block sharing allocates).
Reported: the peak of each and the saving 1 - shared / private (the paper reports 37.6-55.2 %
for beam search on its Alpaca trace; goal >= 37 % at width 4).

Throughput: beams x generated tokens / wall seconds of the beam search, against W greedy
requests of the same prompt and max_tokens run together (they share the prompt through the
prefix cache), median of alternating runs.

Run: `python -m bench.beam_search [--quick]`.
"""

from __future__ import annotations

import random
import time

from base.plan import SamplingParams
from bench.common import engine_for, median, prompt
from bench.suite_cli import suite_main
from control_plane.engine import EngineCore
from worker.worker import Worker
from worker.worker_config import WorkerConfig

WIDTHS = (2, 4, 8)
PROMPT_LENS = (512, 32)


def _beam_run(worker: Worker, ids: list[int], width: int, max_tokens: int) -> dict:
    """One beam search, stepping the engine by hand to sample the memory after every step."""
    engine = engine_for(worker, max_num_seqs=64, caching=True, budget=2048)
    params = SamplingParams(max_tokens=max_tokens, beam_width=width, n=width, ignore_eos=True)
    engine.add_request("beam", ids, params)
    peak_shared = peak_private = 0
    tokens = 0
    started = time.perf_counter()
    while engine.has_work():
        for out in engine.step():
            tokens += len(out.new_token_ids)
        kv = engine.scheduler.kv
        peak_shared = max(peak_shared, kv.pool.num_blocks - 1 - kv.pool.num_free_blocks)
        peak_private = max(peak_private, sum(len(t) for t in kv.tables.values()))
    wall = time.perf_counter() - started
    if tokens != width * max_tokens:
        raise AssertionError(f"width {width}: {tokens} tokens returned, expected {width * max_tokens}")
    return {"seconds": wall, "peak_shared_blocks": peak_shared, "peak_private_blocks": peak_private}


def _greedy_run(worker: Worker, ids: list[int], count: int, max_tokens: int) -> float:
    engine: EngineCore = engine_for(worker, max_num_seqs=64, caching=True, budget=2048)
    for i in range(count):
        engine.add_request(f"g{i}", ids, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    started = time.perf_counter()
    tokens = engine.run_to_completion()
    wall = time.perf_counter() - started
    if sum(len(t) for t in tokens.values()) != count * max_tokens:
        raise AssertionError("greedy requests returned the wrong number of tokens")
    return wall


def run(quick: bool = False) -> dict:
    lengths, repeats = ((64, 128, 256), 2)
    worker = Worker(WorkerConfig(num_blocks=2048))
    _greedy_run(worker, prompt(random.Random(0), 32), 2, 4)  # warm-up
    rows = []
    cases = [(p, m, w) for p in PROMPT_LENS for m in lengths for w in WIDTHS]
    if quick:  # the CI smoke run: the goal's case and one short-prompt case, small
        lengths, repeats, cases = (32,), 1, [(512, 32, 4), (32, 32, 2)]
    for prompt_len, max_tokens, width in cases:
        ids = prompt(random.Random(prompt_len), prompt_len)
        beams, greedy = [], []
        for r in range(repeats):
            order = (0, 1) if r % 2 == 0 else (1, 0)
            for which in order:
                if which == 0:
                    beams.append(_beam_run(worker, ids, width, max_tokens))
                else:
                    greedy.append(_greedy_run(worker, ids, width, max_tokens))
        shared, private = beams[-1]["peak_shared_blocks"], beams[-1]["peak_private_blocks"]
        beam_s, greedy_s = median([b["seconds"] for b in beams]), median(greedy)
        rows.append(
            {
                "prompt": prompt_len,
                "width": width,
                "max_tokens": max_tokens,
                "peak_blocks_shared": shared,
                "peak_blocks_private": private,
                "memory_saving": 1 - shared / private,
                "beam_tokens_per_s": width * max_tokens / beam_s,
                "greedy_tokens_per_s": width * max_tokens / greedy_s,
                "beam_over_greedy_throughput": greedy_s / beam_s,
            }
        )
    result: dict = {"workload": f"prompts {PROMPT_LENS}, widths {WIDTHS}, outputs {lengths}, block 16"}
    result["rows"] = rows
    for row in rows:
        tag = f"p{row['prompt']}_w{row['width']}_out{row['max_tokens']}"
        result[f"memory_saving_{tag}"] = row["memory_saving"]
        result[f"beam_over_greedy_throughput_{tag}"] = row["beam_over_greedy_throughput"]
    long_w4 = [
        row["memory_saving"] for row in rows if row["width"] == 4 and row["prompt"] == max(PROMPT_LENS)
    ]
    result["memory_saving_w4_long_prompt_min"] = min(long_w4)
    return result


def main() -> None:
    suite_main(run, __doc__)


if __name__ == "__main__":
    main()
