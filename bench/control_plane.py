"""Control-plane micro-benchmarks (CPU, no worker): the workloads vLLM v1's block pool and
KV cache manager were measured on, plus a whole schedule()+update() step.

Run: `python -m bench.control_plane [--quick]`. Prints JSON and a table.
"""

from __future__ import annotations

import random

from base.plan import SamplingParams, SeqOutput, StepResult, WorkerInfo
from bench.suite_cli import suite_main
from bench.timing import median_seconds, print_table
from control_plane.block_hash import extend_block_hashes
from control_plane.block_pool import BlockPool
from control_plane.kv_cache_manager import KVCacheManager
from control_plane.request import Request, Sequence
from control_plane.scheduler import Scheduler
from control_plane.scheduler_config import SchedulerConfig

BLOCK = 16


def _info(num_blocks: int, max_len: int = 1 << 16) -> WorkerInfo:
    return WorkerInfo(
        "bench", "none", 32000, max_len, 1, 1, 1, "float16", BLOCK, num_blocks, 1, "none", "bench"
    )


def bench_alloc_free(n: int) -> dict:
    pool = BlockPool(16384)

    def single():
        for _ in range(n):
            pool.free_blocks(pool.get_new_blocks(1))

    def batch32():
        for _ in range(n // 32):
            pool.free_blocks(pool.get_new_blocks(32))

    return {
        "alloc_free_pair_us": median_seconds(single) / n * 1e6,
        "alloc_free_per_block_batch32_us": median_seconds(batch32) / (n // 32 * 32) * 1e6,
    }


def bench_hashing() -> dict:
    tokens = [random.randrange(32000) for _ in range(4096)]
    t = median_seconds(lambda: extend_block_hashes([], tokens, BLOCK, 4096 // BLOCK), repeats=21)
    return {"hash_4096_tokens_us": t * 1e6, "hash_tokens_per_s": 4096 / t}


def _seq(seq_id: int, tokens: list[int]) -> Sequence:
    req = Request(f"r{seq_id}", tokens, SamplingParams())
    return Sequence(seq_id, req, 0, list(tokens))


def bench_prefix_admission(n: int) -> dict:
    kv = KVCacheManager(16384, BLOCK)
    system = [random.randrange(32000) for _ in range(496)]
    warm = _seq(1, system + [1] * 16)
    kv.allocate_slots(warm, warm.num_tokens)
    warm.num_computed_tokens = warm.num_tokens
    kv.cache_full_blocks(warm)
    seqs = [_seq(10 + i, system + [random.randrange(32000) for _ in range(16)]) for i in range(n)]

    def admit():
        for s in seqs:
            hits, n_hit = kv.get_computed_blocks(s)  # includes hashing the prompt's blocks
            kv.allocate_slots(s, s.num_tokens - n_hit, hits)
        for s in seqs:
            kv.free(s)
            s.block_hashes.clear()

    t = median_seconds(admit) / n
    hits, n_hit = kv.get_computed_blocks(seqs[0])
    assert n_hit == 496, n_hit
    return {"admit_512_with_496_cached_us": t * 1e6}


def _decode_scheduler(num_reqs: int, prompt_len: int, caching: bool) -> Scheduler:
    sched = Scheduler(
        SchedulerConfig(max_num_seqs=num_reqs, max_num_batched_tokens=1 << 20, enable_prefix_caching=caching),
        _info(num_reqs * 80 + 64),
    )
    for i in range(num_reqs):
        sched.add_request(
            f"r{i}",
            [random.randrange(32000) for _ in range(prompt_len)],
            SamplingParams(max_tokens=4000, ignore_eos=True),
        )
    plan = sched.schedule()
    sched.update(plan, _fake_result(plan))
    return sched


def _fake_result(plan) -> StepResult:
    outs = [SeqOutput(s.seq_id, [7] * s.num_samples) for s in (*plan.new, *plan.continuing) if s.sample]
    return StepResult(plan.step_id, outs)


def bench_decode_step(steps: int) -> dict:
    sched = _decode_scheduler(256, 1000, caching=True)

    def run():
        for _ in range(steps):
            plan = sched.schedule()
            sched.update(plan, _fake_result(plan))

    t = median_seconds(run, repeats=5, warmup=1) / steps
    return {"schedule_update_256_decodes_us": t * 1e6, "per_request_us": t / 256 * 1e6}


def bench_lifecycle(num_reqs: int, caching: bool) -> dict:
    def run():
        sched = Scheduler(
            SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=64 * 512, enable_prefix_caching=caching),
            _info(64 * 48 + 64),
        )
        for i in range(num_reqs):
            sched.add_request(
                f"r{i}",
                [random.randrange(32000) for _ in range(512)],
                SamplingParams(max_tokens=128, ignore_eos=True),
            )
        while sched.has_pending_work():
            plan = sched.schedule()
            sched.update(plan, _fake_result(plan))

    t = median_seconds(run, repeats=3, warmup=1)
    return {"requests_per_s": num_reqs / t}


def run(quick: bool = False) -> dict:
    random.seed(0)
    res = {}
    res.update(bench_alloc_free(3200 if quick else 32000))
    res.update(bench_hashing())
    res.update(bench_prefix_admission(50 if quick else 500))
    res.update(bench_decode_step(20 if quick else 100))
    res["lifecycle_requests_per_s_hashing"] = bench_lifecycle(64 if quick else 256, True)["requests_per_s"]
    res["lifecycle_requests_per_s_no_hashing"] = bench_lifecycle(64 if quick else 256, False)[
        "requests_per_s"
    ]
    return res


VLLM_REFERENCE = {  # vLLM 0.33.0 on this machine class, from issue #2 (medians, CPython 3.11, block 16)
    "alloc_free_pair_us": 1.09,
    "alloc_free_per_block_batch32_us": 0.46,
    "hash_tokens_per_s": 8.0e6,
    "admit_512_with_496_cached_us": 61.0,
    "schedule_update_256_decodes_us": 1440.0,  # vLLM: allocate_slots only, no scheduling
    "lifecycle_requests_per_s_hashing": 959.0,
    "lifecycle_requests_per_s_no_hashing": 1251.0,
}


def main() -> None:
    res = suite_main(run, __doc__)
    rows = []
    for k, v in res.items():
        ref = VLLM_REFERENCE.get(k)
        rows.append((k, f"{v:,.2f}" + (f"   (vLLM 0.33.0: {ref:,.2f})" if ref else "")))
    print_table("control plane", rows)


if __name__ == "__main__":
    main()
