"""Property-based: random interleavings on small pools keep every invariant at every step,
produce exactly the reference tokens, and leak nothing."""

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from base.plan import SamplingParams
from control_plane.invariants import check_plan, check_pool, check_scheduler
from control_plane.kv_cache_manager import KVCacheManager
from control_plane.sim_worker import reference_tokens
from control_plane.speculation import SpeculativeConfig
from tests.control_plane.helpers import (
    assert_sample_tokens,
    drain_and_check_nothing_leaked,
    interleaving_ops,
    make_engine,
    make_seq,
)

VOCAB = 64  # small vocab: shared prefixes and repeated blocks happen often

request_st = st.tuples(
    st.lists(st.integers(0, 7), min_size=1, max_size=40),  # prompt (tiny alphabet: many cache hits)
    st.integers(1, 12),  # max_tokens
    st.integers(1, 3),  # n
    st.integers(0, 2),  # priority
)
op_st = interleaving_ops(request_st)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    block_size=st.sampled_from([1, 4, 16]),
    extra_blocks=st.integers(0, 6),
    budget=st.sampled_from([8, 32, 256]),
    ops=st.lists(op_st, min_size=1, max_size=40),
)
def test_random_interleavings_keep_invariants(block_size, extra_blocks, budget, ops):
    run_interleaving(block_size, extra_blocks, budget, ops)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    block_size=st.sampled_from([1, 2, 4, 16]),
    window=st.sampled_from([1, 3, 6, 16]),
    extra_blocks=st.integers(0, 6),
    budget=st.sampled_from([8, 32, 256]),
    in_flight=st.sampled_from([1, 2, 3]),
    k=st.sampled_from([0, 0, 1, 3]),
    ops=st.lists(op_st, min_size=1, max_size=40),
)
def test_random_interleavings_with_a_sliding_window_keep_invariants(
    block_size, window, extra_blocks, budget, in_flight, k, ops
):
    """The same, for a model windowed in every layer (SimWorker reads only the window back):
    blocks before each step's window are released (check_plan: exactly those) while n > 1
    forks, windowed prefix hits, preemption, overlap (1-3 plans in flight) and n-gram
    speculation's rollback go on."""
    run_interleaving(block_size, extra_blocks, budget, ops, window, in_flight, k)


def run_interleaving(block_size, extra_blocks, budget, ops, window=0, in_flight=1, k=0):
    """`in_flight` > 1: overlap (EngineCore checks the invariants); `k`: n-gram proposals
    (greedy requests, which SimWorker verifies)."""
    max_len = 64
    num_blocks = -(-max_len // block_size) + 1 + extra_blocks  # one max-length sequence always fits
    engine, worker = make_engine(
        num_blocks=num_blocks,
        block_size=block_size,
        vocab=VOCAB,
        max_model_len=max_len,
        max_num_batched_tokens=budget,
        max_num_seqs=8,
        window=window,
        speculative=SpeculativeConfig("ngram", k, 1, 3) if k else SpeculativeConfig(),
    )
    engine.check_invariants = in_flight > 1  # else checked by hand below, with the plan in view
    engine.plans_in_flight = in_flight
    s = engine.scheduler
    live: dict[str, tuple[list[int], SamplingParams]] = {}
    aborted: set[str] = set()
    got: dict[tuple[str, int], list[int]] = {}

    def step():
        if in_flight > 1:
            for out in engine.step():
                got.setdefault((out.request_id, out.index), []).extend(out.new_token_ids)
            return
        plan = s.schedule()
        check_plan(s, plan)
        check_scheduler(s)
        for out in s.update(plan, worker.execute(plan)):
            got.setdefault((out.request_id, out.index), []).extend(out.new_token_ids)
        check_scheduler(s)

    for i, (op, arg) in enumerate(ops):
        if op == "add":
            prompt, max_tokens, n, prio = arg
            sp = SamplingParams(max_tokens=max_tokens, n=n, temperature=0.0 if k else 1.0)
            rid = f"r{i}"
            s.add_request(rid, prompt, sp, priority=prio)
            live[rid] = (prompt, sp)
        elif op == "step":
            for _ in range(arg):
                step()
        elif op == "abort" and s.requests:
            rid = sorted(s.requests)[arg % len(s.requests)]
            s.abort_request(rid)
            aborted.add(rid)
        elif op == "worker_lost":
            engine._in_flight.clear()  # what the served loop does: plans in flight die with it
            s.on_worker_lost()
            worker.reset()
            check_scheduler(s)
    drain_and_check_nothing_leaked(engine, worker, step)
    for rid, (prompt, sp) in live.items():
        for idx in range(sp.n):
            ref = reference_tokens(prompt, idx, sp.max_tokens, VOCAB, window=window)
            assert_sample_tokens(got, aborted, rid, idx, ref)


kv_op_st = st.lists(
    st.tuples(st.sampled_from(["new", "decode", "fork", "free"]), st.integers(0, 100), st.integers(1, 30)),
    min_size=1,
    max_size=60,
)


@settings(max_examples=80, deadline=None)
@given(block_size=st.sampled_from([1, 4, 16]), num_blocks=st.integers(2, 24), ops=kv_op_st)
def test_kv_manager_fork_cow_free_accounting(block_size, num_blocks, ops):
    kv = KVCacheManager(num_blocks, block_size)
    seqs = []
    for op, pick, length in ops:
        if op == "new":
            seq = make_seq([pick % 5] * length)
            hits, n_hit = kv.get_computed_blocks(seq)
            if kv.allocate_slots(seq, seq.num_tokens - n_hit, hits) is not None:
                seq.num_computed_tokens = seq.num_tokens
                kv.cache_full_blocks(seq)
                seqs.append(seq)
        elif op == "decode" and seqs:
            seq = seqs[pick % len(seqs)]
            seq.token_ids.append(pick % 5)
            alloc = kv.allocate_slots(seq, 1)
            if alloc is None:
                seq.token_ids.pop()
            else:
                table = kv.tables[seq.seq_id]
                assert table[(seq.num_tokens - 1) // block_size].ref_cnt == 1  # written block is exclusive
                seq.num_computed_tokens += 1
                kv.cache_full_blocks(seq)
        elif op == "fork" and seqs:
            parent = seqs[pick % len(seqs)]
            child = make_seq(list(parent.token_ids))
            child.num_computed_tokens = parent.num_computed_tokens
            child.block_hashes = list(parent.block_hashes)
            kv.fork(parent, child, parent.num_computed_tokens)
            seqs.append(child)
        elif op == "free" and seqs:
            kv.free(seqs.pop(pick % len(seqs)))
        check_pool(kv.pool)
        total_refs = sum(len(t) for t in kv.tables.values())
        assert sum(b.ref_cnt for b in kv.pool.blocks) == total_refs
    for seq in seqs:
        kv.free(seq)
    check_pool(kv.pool)
    assert kv.pool.num_free_blocks == num_blocks - 1
