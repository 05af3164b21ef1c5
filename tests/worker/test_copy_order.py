"""Plan.copies take effect in list order, also when a later copy overwrites a block an
earlier copy read -- the shape the scheduler makes when a copy-on-write source is freed by a
preemption and handed out again as a destination in the same step."""

from __future__ import annotations

import random

import torch

from base.plan import Plan, SamplingParams
from control_plane.engine import EngineCore
from control_plane.scheduler_config import SchedulerConfig
from tests.worker.worker_test_utils import make_worker
from worker.kv_cache import copy_batches


def sequential_copies(pool: torch.Tensor, pairs) -> torch.Tensor:
    expected = pool.clone()
    for src, dst in pairs:
        expected[dst] = expected[src]
    return expected


def test_batches_split_only_where_order_matters():
    assert copy_batches([]) == []
    assert copy_batches([(1, 2), (3, 4)]) == [[(1, 2), (3, 4)]]
    assert copy_batches([(1, 2), (3, 1)]) == [[(1, 2)], [(3, 1)]]  # overwrites what was read
    assert copy_batches([(1, 2), (2, 3)]) == [[(1, 2)], [(2, 3)]]  # reads what was written
    assert copy_batches([(1, 2), (1, 3), (4, 1), (5, 6)]) == [[(1, 2), (1, 3)], [(4, 1), (5, 6)]]


def test_random_copy_lists_match_sequential_semantics():
    rng = random.Random(0)
    for _ in range(200):
        blocks = rng.sample(range(1, 40), rng.randint(2, 12))
        dsts = blocks[: len(blocks) // 2]  # each written once
        pairs = [(rng.choice([b for b in blocks if b != d]), d) for d in dsts]
        pool = torch.randn(40, 3)
        actual = pool.clone()
        for batch in copy_batches(pairs):  # one batch: all reads, then all writes
            src, dst = zip(*batch, strict=True)
            actual[list(dst)] = actual[list(src)]
        assert torch.equal(actual, sequential_copies(pool, pairs))


def test_worker_executes_a_chain_in_list_order(checkpoint):
    """(S -> D), (T -> S) in one plan: D ends with S's old K/V, S with T's, in every layer."""
    _, path = checkpoint("qwen3-head-dim-tied")
    worker = make_worker(path, block_size=4, num_blocks=32, max_model_len=64)
    cache = worker.kv_cache
    gen = torch.Generator().manual_seed(1)
    for pool in (*cache.k_caches, *cache.v_caches):
        pool.copy_(torch.randn(pool.shape, generator=gen))
    before = [pool.clone() for pool in (*cache.k_caches, *cache.v_caches)]
    pairs = [(5, 9), (7, 5), (11, 12)]
    worker.execute(Plan(0, copies=pairs))
    for old, pool in zip(before, (*cache.k_caches, *cache.v_caches), strict=True):
        assert torch.equal(pool, sequential_copies(old, pairs))


# Found by searching random workloads: on a 12-block pool these fork (n > 1), copy on write
# and preempt so that one step's plan reads a block and then reuses it as a copy destination.
# (Searched again when n > 1 prompts began to reserve their seats: 327 of 5,000 workloads.)
CHAIN_WORKLOAD = [  # (prompt, max_tokens, n)
    ([6, 0, 2, 2, 3, 4, 5], 5, 1),
    ([6, 2, 7, 1, 2, 5, 6, 0], 14, 2),
    ([7, 0, 1, 7, 2, 0, 0], 14, 3),
    ([5, 1, 5], 8, 2),
    ([1, 0, 7, 5, 1, 4, 2, 6], 9, 3),
]


def _run_chain_workload(path, num_blocks: int) -> tuple[dict, int]:
    worker = make_worker(path, block_size=4, num_blocks=num_blocks, max_model_len=32)
    plans_with_chain = 0
    execute = worker.execute

    def recording_execute(plan):
        nonlocal plans_with_chain
        read: set[int] = set()
        for src, dst in plan.copies:
            plans_with_chain += dst in read
            read.add(src)
        return execute(plan)

    worker.execute = recording_execute
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, enable_prefix_caching=False)
    engine = EngineCore(worker, config, check_invariants=True)
    for i, (prompt, max_tokens, n) in enumerate(CHAIN_WORKLOAD):
        sampling = SamplingParams(max_tokens=max_tokens, n=n, temperature=1.0, seed=i, ignore_eos=True)
        engine.add_request(f"r{i}", prompt, sampling)
    tokens = engine.run_to_completion()
    assert engine.scheduler.kv.pool.num_free_blocks == num_blocks - 1  # nothing leaked
    return tokens, plans_with_chain


def test_scheduler_copy_chains_run_on_the_real_worker(checkpoint):
    """The control plane's chained copies are accepted and give the same seeded tokens as a
    pool large enough that nothing is preempted."""
    _, path = checkpoint("qwen3-head-dim-tied")
    tight, chains = _run_chain_workload(path, num_blocks=12)
    ample, no_chains = _run_chain_workload(path, num_blocks=256)
    assert chains >= 1 and no_chains == 0
    assert tight == ample
    assert sorted(len(t) for t in tight.values()) == sorted(m for _, m, n in CHAIN_WORKLOAD for _ in range(n))
