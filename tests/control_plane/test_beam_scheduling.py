"""Beam groups on tight pools with the paging-checking SimWorker: every plan is checked (no
write into a shared block, invariants incl. the group rules), every beam search returns what
an unpaged run of the same search returns, every sample its unpaged tokens, and nothing leaks;
on two workloads found by a search and on random ones (hypothesis).

The two workloads were found by a random search after the 64-client soak failed a plan
("writes into block 10, which 2 sequences' tables reference"): a preempted beam group was
re-admitted with its members' prefix hits looked up first and allocated one member at a
time, so a free cached block one member hit was evicted and handed to another member as a
fresh block. Both fail without the fix (scheduler_beams._admit_beam_group holds all hits first).
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from base.plan import SamplingParams
from control_plane.beam_search import BeamSearch
from control_plane.engine import EngineCore
from control_plane.invariants import check_all_free
from control_plane.scheduler_config import SchedulerConfig
from control_plane.sim_worker import SimWorker, reference_beams, reference_tokens

VOCAB = 64

# (block size, blocks, token budget, plans in flight, [(prompt, max_tokens, beam width or 0, n)])
WORKLOADS = {
    "strict": (
        4,
        14,
        16,
        1,
        [
            ([30, 2, 7, 18, 47, 30, 14, 43, 56, 40], 9, 2, 2),
            ([30, 2, 7, 18, 22], 2, 3, 1),
            ([30, 2, 7, 10, 30], 6, 4, 3),
            ([33, 44, 29, 26, 45, 40, 28, 39, 56, 9], 6, 2, 2),
            ([33, 44, 29, 26, 45, 40, 28], 6, 0, 1),
        ],
    ),
    "overlap": (
        4,
        16,
        64,
        2,
        [
            ([62, 26, 54, 46, 27, 58, 37, 8, 59, 4, 33], 9, 2, 1),
            ([39, 5, 35, 57, 63, 25, 22, 39, 35], 8, 2, 1),
            ([39, 5, 35, 57, 63, 13, 43, 29], 10, 3, 2),
            ([39, 5, 35, 57, 63, 25, 22, 39, 13, 8, 1], 8, 0, 1),
        ],
    ),
}


def run_and_check(block_size, num_blocks, budget, in_flight, requests, window=0) -> EngineCore:
    """`window` > 0: a sliding-window model (SimWorker's; blocks before the window are freed)."""
    worker = SimWorker(num_blocks=num_blocks, block_size=block_size, vocab_size=VOCAB, window=window)
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget, enable_prefix_caching=True)
    engine = EngineCore(worker, config, check_invariants=True, plans_in_flight=in_flight)
    for i, (prompt, max_tokens, width, n) in enumerate(requests):
        if width:
            params = SamplingParams(max_tokens=max_tokens, beam_width=width, n=n, ignore_eos=True)
        else:
            params = SamplingParams(max_tokens=max_tokens, n=n, ignore_eos=True)
        engine.add_request(f"r{i}", prompt, params)
    tokens = engine.run_to_completion()
    check_all_free(engine.scheduler)
    assert worker.tables == {}, "the worker still mirrors sequences"
    for i, (prompt, max_tokens, width, n) in enumerate(requests):
        if width:
            search = BeamSearch(width, 1.0, max_tokens, frozenset())
            expected = [h.token_ids for h in reference_beams(prompt, search, VOCAB, window)[:n]]
        else:
            expected = [
                reference_tokens(prompt, index, max_tokens, VOCAB, window=window) for index in range(n)
            ]
        assert [tokens[(f"r{i}", index)] for index in range(n)] == expected, f"r{i}"
    return engine


@pytest.mark.parametrize("name", list(WORKLOADS))
def test_beam_groups_readmitted_with_shared_prefix_hits_match_the_unpaged_reference(name):
    engine = run_and_check(*WORKLOADS[name])
    assert engine.scheduler.num_preemptions > 0, "the pool was not tight enough to preempt"


@st.composite
def beam_workloads(draw):
    """Beam and sampled requests over two shared stems (prefix hits), on a tight pool."""
    block_size = 4
    num_blocks = draw(st.integers(10, 20))  # tight: cached blocks get evicted and reused
    stems = [draw(st.lists(st.integers(0, VOCAB - 1), min_size=3 * block_size, max_size=3 * block_size))]
    stems.append(draw(st.lists(st.integers(0, VOCAB - 1), min_size=3 * block_size, max_size=3 * block_size)))
    requests = []
    for _ in range(draw(st.integers(4, 8))):
        stem = draw(st.sampled_from(stems))
        prompt = stem[: draw(st.integers(1, len(stem)))] + draw(
            st.lists(st.integers(0, VOCAB - 1), max_size=3)
        )
        max_tokens = draw(st.integers(1, 10))
        width = draw(st.sampled_from([0, 2, 3, 4]))
        n = draw(st.integers(1, max(width, 2)))
        blocks = -(-(len(prompt) + max_tokens) // block_size) * max(width, n)
        if blocks <= num_blocks - 1:
            requests.append((prompt, max_tokens, width, n))
    budget = draw(st.sampled_from([8, 16, 64]))
    return block_size, num_blocks, budget, draw(st.sampled_from([1, 2, 3])), requests


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workload=beam_workloads())
def test_random_beam_workloads_match_the_unpaged_reference(workload):
    run_and_check(*workload)
