"""Preemption (issue 6): a workload whose KV demand is 3x the pool, on the default model.

N requests (random byte prompts, greedy, ignore_eos) are queued at once; each needs
ceil((prompt + output) / 16) blocks, and together they need 3x the pool's real blocks, so the
scheduler must preempt (recompute) to finish them. The same workload on a pool large enough
for all of it (no preemption) is the reference; runs alternate. In-process `EngineCore` +
`Worker(num_blocks=...)`: the serving stack adds nothing to what is measured here.

Asserted: every request completes with exactly its max_tokens (none OUT_OF_MEMORY, none
lost). Reported: throughput both ways, preemptions, and whether the greedy tokens matched
the unpreempted run (recompute should not change them; float reductions over a different
batch make an exact match likely, not guaranteed, so it is reported, not asserted).

Run: `python -m bench.preemption [--quick]`.
"""

from __future__ import annotations

import math
import random
import time

from bench.common import add_requests, engine_for, median
from bench.suite_cli import suite_main
from worker.worker import Worker
from worker.worker_config import WorkerConfig

OVERSUBSCRIPTION = 3


def _run_workload(worker: Worker, num_reqs: int, prompt_len: int, max_tokens: int) -> dict:
    engine = engine_for(worker, max_num_seqs=64, caching=True, budget=2048)
    add_requests(engine, random.Random(11), num_reqs, prompt_len, max_tokens, tag="pre")
    started = time.perf_counter()
    tokens = engine.run_to_completion()
    wall = time.perf_counter() - started
    incomplete = [k for k in tokens if len(tokens[k]) != max_tokens]
    reasons = {getattr(r, "name", str(r)) for r in engine.finish_reasons.values()}
    if len(tokens) != num_reqs or incomplete:
        raise AssertionError(
            f"{len(tokens)}/{num_reqs} requests finished, incomplete: {incomplete}, {reasons}"
        )
    return {
        "seconds": wall,
        "tokens": [tokens[k] for k in sorted(tokens)],
        "preemptions": engine.scheduler.num_preemptions,
        "finish_reasons": sorted(reasons),
    }


def run(quick: bool = False) -> dict:
    num_reqs, prompt_len, max_tokens, repeats = (6, 64, 64, 1) if quick else (12, 128, 128, 2)
    blocks_per_req = math.ceil((prompt_len + max_tokens) / 16)
    pool_blocks = num_reqs * blocks_per_req // OVERSUBSCRIPTION
    small = Worker(WorkerConfig(num_blocks=pool_blocks + 1))  # + the null block
    ample = Worker(WorkerConfig(num_blocks=num_reqs * blocks_per_req + 1))
    _run_workload(ample, 2, prompt_len, 4)  # warm-up
    runs: dict[str, list[dict]] = {"oversubscribed": [], "ample": []}
    for r in range(repeats):
        order = ("oversubscribed", "ample") if r % 2 == 0 else ("ample", "oversubscribed")
        for name in order:
            worker = small if name == "oversubscribed" else ample
            runs[name].append(_run_workload(worker, num_reqs, prompt_len, max_tokens))
    over, ref = runs["oversubscribed"], runs["ample"]
    total_tokens = num_reqs * max_tokens
    over_s, ref_s = median([r["seconds"] for r in over]), median([r["seconds"] for r in ref])
    return {
        "workload": f"{num_reqs} requests x ({prompt_len} prompt + {max_tokens} output), all queued at once",
        "pool_blocks": pool_blocks,
        "demand_blocks": num_reqs * blocks_per_req,
        "oversubscription": num_reqs * blocks_per_req / pool_blocks,
        "completed_requests": num_reqs,
        "all_completed": True,  # _run_workload raised otherwise
        "finish_reasons": ",".join(over[-1]["finish_reasons"]),
        "preemptions_per_run": over[-1]["preemptions"],
        "oversubscribed_tokens_per_s": total_tokens / over_s,
        "ample_pool_tokens_per_s": total_tokens / ref_s,
        "throughput_ratio_vs_ample": ref_s / over_s,
        "tokens_match_ample_run": over[-1]["tokens"] == ref[-1]["tokens"],
    }


def main() -> None:
    suite_main(run, __doc__)


if __name__ == "__main__":
    main()
