"""Sliding window (issue 31): blocks wholly before a step's window are returned to the pool.

Against the torch-free SimWorker with a window (the next token depends on the last `window`
tokens, read back through the block table; a release the window still reads is refused), under
the invariant checker at every step (EngineCore(check_invariants=True): check_plan demands that
exactly the entries before each step's window are released, and says so in the plan):

  - a long generation holds a window's worth of blocks, counted exactly at every step;
  - preemption, windowed prefix hits (including a hit whose earliest blocks were evicted),
    n > 1 forks (with overlap running the parent ahead of its children), beam search and
    speculative rollback keep the reference tokens and leak nothing.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from base.plan import NULL_BLOCK_ID, SamplingParams
from control_plane.beam_search import BeamSearch
from control_plane.engine import EngineCore
from control_plane.invariants import check_all_free
from control_plane.scheduler_config import SchedulerConfig
from control_plane.sim_worker import SimWorker, reference_beams, reference_tokens
from control_plane.speculation import SpeculativeConfig
from tests.control_plane.helpers import make_engine
from tests.control_plane.test_beam_scheduling import beam_workloads, run_and_check

VOCAB = 50


def record_held(engine: EngineCore) -> list[tuple[int, int, int]]:
    """After every schedule(): (start_pos, end, blocks the sequence holds) per scheduled item."""
    sched = engine.scheduler
    seen: list[tuple[int, int, int]] = []
    schedule = sched.schedule

    def recording():
        plan = schedule()
        for item in (*plan.new, *plan.continuing):
            seen.append(
                (item.start_pos, item.start_pos + item.num_inputs, sched.kv.num_blocks_held(item.seq_id))
            )
        return plan

    sched.schedule = recording
    return seen


def expected_held(start: int, end: int, window: int, block_size: int) -> int:
    """Blocks a step computing positions [start, end) holds: from the block its first position's
    window begins in through the block of its last position."""
    return -(-end // block_size) - max(start - window + 1, 0) // block_size


@pytest.mark.parametrize(
    ("window", "block_size", "in_flight"), [(32, 16, 1), (32, 16, 2), (20, 4, 1), (7, 4, 3)]
)
def test_a_generation_to_8x_the_window_holds_a_window_of_blocks_at_every_step(window, block_size, in_flight):
    prompt = [(5 * i + 1) % VOCAB for i in range(window + 5)]  # the prefill already slides
    max_tokens = 8 * window
    engine, worker = make_engine(
        num_blocks=64, block_size=block_size, vocab=VOCAB, window=window, max_num_batched_tokens=256
    )
    engine.plans_in_flight = in_flight
    engine.add_request("r", prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    sched = engine.scheduler
    bound = window // block_size + 2  # the goal
    steps = record_held(engine)
    tokens: list[int] = []
    while engine.has_work():
        for out in engine.step():
            tokens.extend(out.new_token_ids)
    for start, end, count in steps:
        assert count == expected_held(start, end, window, block_size), (start, end)
    counts = [count for _, _, count in steps]
    assert tokens == reference_tokens(prompt, 0, max_tokens, VOCAB, window=window)
    decode_max = max(counts[1:])
    assert decode_max == (window + block_size - 2) // block_size + 1  # blocks [s - window + 1, s] can span
    assert decode_max <= bound
    assert counts[0] == -(-len(prompt) // block_size)  # the prompt's one step writes all of it
    check_all_free(sched)
    assert not worker.tables


def test_a_model_with_some_full_layer_keeps_every_block():
    """ModelFacts.sliding_window 0 (no window, or a mixed model): nothing is released."""
    engine, _ = make_engine(num_blocks=64, block_size=4, vocab=VOCAB, window=0)
    engine.add_request("r", list(range(10)), SamplingParams(max_tokens=40, ignore_eos=True))
    steps = record_held(engine)
    engine.run_to_completion()
    assert [count for _, _, count in steps] == [-(-end // 4) for _, end, _ in steps]
    assert steps[-1][2] == -(-(10 + 40 - 1) // 4)


def test_preempted_windowed_sequences_resume_from_their_window_and_keep_the_tokens():
    """Three long sequences on a pool of 8 blocks (each holds up to 3): preemption frees a
    table with released entries; the resumed sequence hits its cached window blocks (the
    windowed lookup), recomputes only what follows, and the tokens are the reference's."""
    window, block_size = 8, 4
    engine, worker = make_engine(
        num_blocks=9, block_size=block_size, vocab=VOCAB, window=window, max_num_batched_tokens=16
    )
    prompts = [[(7 * i + r) % VOCAB for i in range(6 + 5 * r)] for r in range(3)]
    for r, prompt in enumerate(prompts):
        engine.add_request(f"r{r}", prompt, SamplingParams(max_tokens=60, ignore_eos=True))
    tokens = engine.run_to_completion()
    sched = engine.scheduler
    assert sched.num_preemptions > 0, "the pool was not tight enough to preempt"
    assert sched.kv.prefix_hits > 0, "no resumed sequence hit its window blocks"
    for r, prompt in enumerate(prompts):
        assert tokens[(f"r{r}", 0)] == reference_tokens(prompt, 0, 60, VOCAB, window=window)
    check_all_free(sched)
    assert not worker.tables


def test_a_prefix_hit_needs_only_the_window_even_when_earlier_blocks_were_evicted():
    """A's prompt blocks before the window are released early (cached, first to be evicted).
    C then evicts A's first blocks. B shares A's prompt: the plain lookup would stop at block 0;
    the windowed lookup hits every prompt block whose window blocks are cached, and B's table
    starts with released entries. B's tokens are the reference's (SimWorker reads the window
    back through B's table, so a wrong hit would change them)."""
    window, block_size = 8, 4
    engine, worker = make_engine(num_blocks=16, block_size=block_size, vocab=VOCAB, window=window)
    sched = engine.scheduler
    prompt_a = [(3 * i + 2) % VOCAB for i in range(40)]
    engine.add_request("a", prompt_a, SamplingParams(max_tokens=4, ignore_eos=True))
    engine.run_to_completion()
    engine.add_request("c", [49 - i % 7 for i in range(28)], SamplingParams(max_tokens=1, ignore_eos=True))
    engine.run_to_completion()
    prompt_b = prompt_a + [1, 2, 3, 4]
    seen: list = []
    original_schedule = sched.schedule

    def schedule():
        plan = original_schedule()
        seen.extend(plan.new)
        return plan

    sched.schedule = schedule
    cached_before = set(sched.kv.pool.cached)
    engine.add_request("b", prompt_b, SamplingParams(max_tokens=12, ignore_eos=True))
    seq_b = sched.requests["b"].sequences[0]
    sched.kv._hash_blocks(seq_b, 10)
    assert seq_b.block_hashes[0] not in cached_before, "A's first block was not evicted"
    tokens = engine.run_to_completion()
    (new_b,) = seen
    assert new_b.start_pos == 40  # every full prompt block of A's hit
    released = (40 - window + 1) // block_size
    assert new_b.block_ids[:released] == [NULL_BLOCK_ID] * released
    assert NULL_BLOCK_ID not in new_b.block_ids[released:]
    assert tokens[("b", 0)] == reference_tokens(prompt_b, 0, 12, VOCAB, window=window)
    check_all_free(sched)
    assert not worker.tables


@pytest.mark.parametrize("in_flight", [1, 2, 3])
@pytest.mark.parametrize("prompt_len", range(8, 17))
def test_n_samples_fork_from_a_parent_that_released_blocks(prompt_len, in_flight):
    """n = 3 with every prompt length across a block: with overlap the parent may have released
    a block its children still read (KVCacheManager.fork takes it back from the cache)."""
    window, block_size, n = 6, 4, 3
    engine, worker = make_engine(num_blocks=48, block_size=block_size, vocab=VOCAB, window=window)
    engine.plans_in_flight = in_flight
    prompt = [(11 * i + prompt_len) % VOCAB for i in range(prompt_len)]
    engine.add_request("r", prompt, SamplingParams(max_tokens=20, n=n, temperature=1.0, ignore_eos=True))
    tokens = engine.run_to_completion()
    for index in range(n):
        assert tokens[("r", index)] == reference_tokens(prompt, index, 20, VOCAB, window=window)
    check_all_free(engine.scheduler)
    assert not worker.tables


def test_a_child_whose_blocks_left_the_cache_recomputes():
    """Without prefix caching a block released by a parent that ran ahead cannot be taken
    back: the child waits and recomputes, with the same tokens."""
    window, block_size = 6, 4
    engine, worker = make_engine(
        num_blocks=48, block_size=block_size, vocab=VOCAB, window=window, enable_prefix_caching=False
    )
    engine.plans_in_flight = 3
    prompt = [(11 * i + 10) % VOCAB for i in range(12)]  # position 13 (2 ahead) leaves block 1
    engine.add_request("r", prompt, SamplingParams(max_tokens=20, n=2, temperature=1.0, ignore_eos=True))
    steps = record_held(engine)
    tokens = engine.run_to_completion()
    assert [start for start, _, _ in steps].count(0) == 2  # the parent's prompt, the child's recompute
    for index in range(2):
        assert tokens[("r", index)] == reference_tokens(prompt, index, 20, VOCAB, window=window)
    check_all_free(engine.scheduler)
    assert not worker.tables


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workload=beam_workloads(), window=st.sampled_from([1, 3, 5, 9]))
def test_random_beam_workloads_with_a_window_match_the_unpaged_reference(workload, window):
    """tests/control_plane/test_beam_scheduling.py's workloads (beams and samples over shared
    stems on a tight pool: evictions, preemption of whole groups, 1-3 plans in flight) with a
    window: beams share released entries and free what they all left behind."""
    run_and_check(*workload, window=window)


def test_beam_search_with_a_window_matches_the_reference():
    window, block_size = 5, 2
    worker = SimWorker(num_blocks=64, block_size=block_size, vocab_size=VOCAB, window=window)
    engine = EngineCore(worker, SchedulerConfig(max_num_seqs=8), check_invariants=True)
    prompt = [(9 * i + 4) % VOCAB for i in range(7)]
    engine.add_request("b", prompt, SamplingParams(max_tokens=16, beam_width=3, n=2, ignore_eos=True))
    tokens = engine.run_to_completion()
    search = BeamSearch(3, 1.0, 16, frozenset())
    expected = [h.token_ids for h in reference_beams(prompt, search, VOCAB, window=window)[:2]]
    assert [tokens[("b", i)] for i in range(2)] == expected
    check_all_free(engine.scheduler)


@pytest.mark.parametrize("in_flight", [1, 2])
def test_speculative_rollback_with_released_blocks_keeps_the_tokens(in_flight):
    """A repetitive greedy stream: n-gram proposals are accepted and rejected while the window
    slides; a rollback never reaches a released entry (invariants) and tokens are the reference's."""
    window, block_size = 6, 2
    engine, worker = make_engine(
        num_blocks=48,
        block_size=block_size,
        vocab=4,
        window=window,
        speculative=SpeculativeConfig("ngram", 3, 1, 3),
    )
    engine.plans_in_flight = in_flight
    prompt = [0, 1, 2, 3] * 3
    engine.add_request("s", prompt, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    tokens = engine.run_to_completion()
    assert tokens[("s", 0)] == reference_tokens(prompt, 0, 40, 4, window=window)
    stats = engine.scheduler.speculator.stats
    assert stats.num_accepted > 0 and stats.num_proposed > stats.num_accepted
    check_all_free(engine.scheduler)
    assert not worker.tables


def test_the_request_check_counts_what_a_windowed_sequence_holds():
    """A request longer than the pool fits when its window and chunk do."""
    engine, _ = make_engine(
        num_blocks=12, block_size=4, vocab=VOCAB, window=8, max_num_batched_tokens=16, max_model_len=256
    )
    long_request = SamplingParams(max_tokens=100, ignore_eos=True)  # 30 blocks at full length
    engine.add_request("long", [1] * 20, long_request)
    tokens = engine.run_to_completion()
    assert len(tokens[("long", 0)]) == 100
    check_all_free(engine.scheduler)
