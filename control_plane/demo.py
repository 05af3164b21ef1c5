"""In-process demo of the control plane (what `make run` runs until the gRPC services land).

Drives the real scheduler, block pool, prefix cache and copy-on-write against the SimWorker
(a torch-free worker that stores token ids as its KV and reads every context back through the
block tables), and prints the block tables and pool statistics as requests run.
"""

from __future__ import annotations

import argparse
import random

from base.plan import SamplingParams
from control_plane.engine import EngineCore
from control_plane.invariants import check_all_free
from control_plane.scheduler_config import SchedulerConfig
from control_plane.sim_worker import SimWorker, reference_tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--num-blocks", type=int, default=48)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--requests", type=int, default=12)
    args = ap.parse_args()
    rng = random.Random(0)
    worker = SimWorker(args.num_blocks, args.block_size, vocab_size=1000)
    engine = EngineCore(worker, SchedulerConfig(max_num_batched_tokens=256), check_invariants=True)
    system = [rng.randrange(1000) for _ in range(40)]  # a shared "system prompt": 2 full blocks
    prompts = {}
    for i in range(args.requests):
        prompts[f"req-{i}"] = system + [rng.randrange(1000) for _ in range(rng.randrange(1, 60))]
        n = 2 if i % 4 == 0 else 1
        engine.add_request(
            f"req-{i}", prompts[f"req-{i}"], SamplingParams(max_tokens=40, n=n, temperature=1.0)
        )
    s = engine.scheduler
    print(f"pool: {args.num_blocks - 1} blocks x {args.block_size} tokens; {args.requests} requests")
    tokens: dict = {}
    while s.has_pending_work():
        for out in engine.step():
            tokens.setdefault((out.request_id, out.index), []).extend(out.new_token_ids)
        if s.num_steps % 10 == 1 and s.running:
            seq = s.running[0]
            st = s.stats()
            print(
                f"step {s.num_steps:3d}: running={st.num_running} waiting={st.num_waiting} "
                f"free={st.num_blocks_free} usage={st.kv_usage:.2f} preemptions={st.num_preemptions} | "
                f"{seq.request.request_id}[{seq.sample_index}] table={s.kv.block_ids(seq.seq_id)}"
            )
    check_all_free(s)
    ok = all(
        tokens[(rid, i)] == reference_tokens(p, i, 40, 1000) for (rid, i) in tokens for p in [prompts[rid]]
    )
    st = s.stats()
    print(
        f"done: {len(tokens)} samples, tokens match the unpaged reference: {ok}; "
        f"prefix-cache hit rate {st.prefix_cache_hit_rate:.2f}; copies-on-write {worker.num_copies}; "
        f"preemptions {st.num_preemptions}; free blocks {st.num_blocks_free}/{st.num_blocks_total}"
    )
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
