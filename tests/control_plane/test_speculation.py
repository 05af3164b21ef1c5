"""Speculative decoding on the control plane (control_plane/speculation.py): the n-gram
proposer, rollback of rejected slots, and -- against the torch-free SimWorker, which verifies
by reading every position back through the block tables -- exact reference tokens with
speculation under preemption, aborts, n > 1, stop ids, worker loss and 1-3 plans in flight."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from base.plan import SamplingParams, SeqOutput, StepResult
from control_plane.invariants import check_all_free, check_scheduler
from control_plane.request import FinishReason
from control_plane.sim_worker import reference_tokens
from control_plane.speculation import SpeculationStats, SpeculativeConfig, propose_ngram
from tests.control_plane.helpers import interleaving_ops, make_engine


def naive_ngram(tokens: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    num = len(tokens)
    for n in range(min(n_max, num - 1), n_min - 1, -1):
        suffix = tokens[num - n :]
        for i in range(num - n - 1, -1, -1):
            if tokens[i : i + n] == suffix:
                out = list(tokens)  # the continuation goes on with its own proposals
                for j in range(i + n, i + n + k):
                    out.append(out[j])
                return out[num:]
    return []


def test_ngram_takes_the_longest_suffix_and_its_most_recent_occurrence():
    assert propose_ngram([1, 2, 3, 4, 1, 2], 2, 1, 3) == [3, 4]
    # [9, 1, 2] occurs once (-> 7); [1, 2] alone more recently (-> 5): the longer wins
    assert propose_ngram([9, 1, 2, 7, 1, 2, 5, 9, 1, 2], 1, 2, 3) == [7]
    assert propose_ngram([1, 2, 8, 1, 2, 6, 1, 2], 3, 2, 2) == [6, 1, 2]
    assert propose_ngram([1, 2, 3], 3, 1, 3) == []
    # a loop continues past the end: period 1, then period 3
    assert propose_ngram([5, 5], 4, 1, 1) == [5, 5, 5, 5]
    assert propose_ngram([7, 1, 2, 3, 1, 2, 3], 5, 2, 2) == [1, 2, 3, 1, 2]
    assert propose_ngram([1, 2, 1], 0, 1, 2) == []


def test_ngram_matches_whole_tokens_only():
    # Byte patterns that straddle token boundaries must not match: as bytes, [0x100, 0] holds
    # the bytes of [1, 0]... shifted by one (00 01 00 00 00 00 00 00).
    tokens = [0x100, 0, 7, 1, 0]
    assert propose_ngram(tokens, 2, 2, 2) == naive_ngram(tokens, 2, 2, 2) == []
    rng = random.Random(0)
    values = [0, 1, 2, 256, 65536, 1 << 24, 0x01010101, 2**32 - 1]
    for _ in range(2000):
        tokens = [rng.choice(values) for _ in range(rng.randint(1, 14))]
        k, lo = rng.randint(1, 4), rng.randint(1, 3)
        hi = rng.randint(lo, 4)
        assert propose_ngram(tokens, k, lo, hi) == naive_ngram(tokens, k, lo, hi), (tokens, k, lo, hi)


def test_stats_per_position():
    stats = SpeculationStats()
    stats.record(3, 2)
    stats.record(2, 0)
    stats.record(1, 1)
    assert stats.proposed_per_position == [3, 2, 1]
    assert stats.accepted_per_position == [2, 1, 0]
    assert stats.acceptance_per_position() == [2 / 3, 1 / 2, 0.0]
    assert stats.mean_accepted_length == 1.0
    assert stats.acceptance_rate == 3 / 6


def test_config_is_validated():
    with pytest.raises(ValueError, match="one of"):
        SpeculativeConfig(method="medusa").validate()
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        SpeculativeConfig(method="ngram", prompt_lookup_min=3, prompt_lookup_max=2).validate()


def _spec(
    k: int = 3, lo: int = 1, hi: int = 3, max_batch: int = 8, method: str = "ngram"
) -> SpeculativeConfig:
    return SpeculativeConfig(method, k, lo, hi, max_batch)


@pytest.mark.parametrize("accepted", [0, 1, 3])
def test_rejected_slots_roll_back_and_their_blocks_return_at_once(accepted):
    """Block size 1: every proposal has its own block. A verify of 3 keeping `accepted` frees
    the 3 - accepted blocks only rejected positions reached, in the same update."""
    engine, _ = make_engine(num_blocks=32, block_size=1, vocab=8, speculative=_spec(k=3))
    s = engine.scheduler
    prompt = [1, 2, 3, 4, 1, 2, 3, 4, 1]
    s.add_request("r", prompt, SamplingParams(max_tokens=10))
    first = s.schedule()
    s.update(first, StepResult(first.step_id, [SeqOutput(first.new[0].seq_id, [2])]))  # prompt + 2
    seq = s.requests["r"].sequences[0]
    free_before = s.kv.pool.num_free_blocks
    plan = s.schedule()
    (c,) = plan.continuing
    assert c.token_ids == [2, 3, 4, 1] and c.num_speculative_tokens == 3 and c.start_pos == 9
    assert s.kv.pool.num_free_blocks == free_before - 4 and seq.num_computed_tokens == 13
    check_scheduler(s)
    tokens = [3, 4, 1][:accepted] + [7]  # the accepted proposals, then the worker's own sample
    (out,) = s.update(plan, StepResult(plan.step_id, [SeqOutput(c.seq_id, tokens)]))
    assert out.new_token_ids == tokens
    assert seq.num_tokens == 10 + accepted + 1 and seq.num_computed_tokens == 10 + accepted
    assert len(s.kv.tables[seq.seq_id]) == 10 + accepted
    assert s.kv.pool.num_free_blocks == free_before - 1 - accepted
    assert seq.num_synced_blocks == 10 + accepted
    check_scheduler(s)
    stats = s.speculator.stats
    assert (stats.num_verifies, stats.num_proposed, stats.num_accepted) == (1, 3, accepted)


def test_a_draft_verify_asks_the_worker_for_k_proposals_and_reserves_their_slots():
    """--speculative draft: the plan sends the one known input and num_draft_tokens = k; the
    slots of all 1 + k positions are allocated, and the result rolls back like an n-gram one."""
    engine, _ = make_engine(num_blocks=32, block_size=1, vocab=8, speculative=_spec(k=3, method="draft"))
    s = engine.scheduler
    s.add_request("r", [5, 6, 7], SamplingParams(max_tokens=10))
    first = s.schedule()
    s.update(first, StepResult(first.step_id, [SeqOutput(first.new[0].seq_id, [2])]))
    seq = s.requests["r"].sequences[0]
    free_before = s.kv.pool.num_free_blocks
    plan = s.schedule()
    (c,) = plan.continuing
    assert (c.token_ids, c.num_speculative_tokens, c.num_draft_tokens, c.start_pos) == ([2], 0, 3, 3)
    assert c.num_inputs == 4 and seq.num_computed_tokens == 7
    assert s.kv.pool.num_free_blocks == free_before - 4
    check_scheduler(s)
    (out,) = s.update(plan, StepResult(plan.step_id, [SeqOutput(c.seq_id, [4, 1])]))
    assert out.new_token_ids == [4, 1] and seq.num_computed_tokens == 5
    assert s.kv.pool.num_free_blocks == free_before - 2
    check_scheduler(s)
    assert (s.speculator.stats.num_proposed, s.speculator.stats.num_accepted) == (3, 1)


def test_a_stop_inside_an_accepted_run_drops_the_rest_and_counts_exactly():
    engine, _ = make_engine(num_blocks=32, block_size=4, vocab=8, speculative=_spec(k=3))
    s = engine.scheduler
    s.add_request("r", [1, 2, 3, 4, 1, 2, 3, 4, 1], SamplingParams(max_tokens=10, stop_token_ids=(3,)))
    first = s.schedule()
    s.update(first, StepResult(first.step_id, [SeqOutput(first.new[0].seq_id, [2])]))
    plan = s.schedule()
    (c,) = plan.continuing
    assert c.num_speculative_tokens == 3
    (out,) = s.update(plan, StepResult(plan.step_id, [SeqOutput(c.seq_id, [3, 4, 1, 5])]))
    assert out.new_token_ids == [3] and out.finish_reason == FinishReason.STOP
    assert out.usage.completion_tokens == 2
    check_all_free(s)


def test_max_tokens_caps_the_proposals():
    engine, _ = make_engine(num_blocks=32, block_size=4, vocab=8, speculative=_spec(k=4))
    s = engine.scheduler
    s.add_request("r", [1, 2, 3, 4, 1, 2, 3, 4, 1], SamplingParams(max_tokens=3))
    first = s.schedule()
    s.update(first, StepResult(first.step_id, [SeqOutput(first.new[0].seq_id, [2])]))
    (c,) = s.schedule().continuing
    assert c.num_speculative_tokens == 1  # 1 output so far: 1 proposal + the step's own = 3


def test_opted_out_and_penalized_requests_do_not_speculate_sampled_ones_do():
    engine, _ = make_engine(
        num_blocks=64, block_size=4, vocab=8, speculative=_spec(), enable_prefix_caching=False
    )
    s = engine.scheduler
    prompt = [1, 2, 3, 4, 1, 2, 3, 4, 1]
    s.add_request("off", prompt, SamplingParams(max_tokens=8, disable_speculation=True))
    s.add_request("hot", prompt, SamplingParams(max_tokens=8, temperature=1.0, seed=1))
    s.add_request("pen", prompt, SamplingParams(max_tokens=8, repetition_penalty=1.2))
    s.add_request("on", prompt, SamplingParams(max_tokens=8))
    first = s.schedule()
    s.update(first, StepResult(first.step_id, [SeqOutput(n.seq_id, [2]) for n in first.new]))
    plan = s.schedule()
    spec = {s.seqs[c.seq_id].request.request_id: c.num_speculative_tokens for c in plan.continuing}
    assert spec == {"off": 0, "hot": 3, "pen": 0, "on": 3}


def test_no_speculation_above_the_batch_cap():
    engine, _ = make_engine(
        num_blocks=64, block_size=4, vocab=8, speculative=_spec(max_batch=1), enable_prefix_caching=False
    )
    s = engine.scheduler
    for rid in ("a", "b"):
        s.add_request(rid, [1, 2, 3, 4, 1, 2, 3, 4, 1], SamplingParams(max_tokens=8))
    first = s.schedule()
    s.update(first, StepResult(first.step_id, [SeqOutput(n.seq_id, [2]) for n in first.new]))
    assert all(c.num_speculative_tokens == 0 for c in s.schedule().continuing)


VOCAB = 4  # the SimWorker's tokens are a hash of the context: a tiny vocabulary repeats often

request_st = st.tuples(
    st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=24),  # prompt
    st.integers(1, 14),  # max_tokens
    st.integers(1, 3),  # n
    st.integers(0, 2),  # priority
    st.lists(st.integers(0, VOCAB - 1), max_size=1),  # stop ids
)
op_st = interleaving_ops(request_st)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    block_size=st.sampled_from([1, 2, 4]),
    extra_blocks=st.integers(0, 6),
    budget=st.sampled_from([4, 16, 256]),
    in_flight=st.sampled_from([1, 2, 3]),
    k=st.integers(1, 4),
    ops=st.lists(op_st, min_size=1, max_size=30),
    method=st.sampled_from(["ngram", "draft"]),
)
def test_speculation_gives_the_reference_tokens_and_keeps_invariants(
    block_size, extra_blocks, budget, in_flight, k, ops, method
):
    """Both proposers (the SimWorker's draft stand-in errs about one proposal in three).
    Invariants (with rollback's: no block past the computed positions, no cached block
    holding an unaccepted token) after every plan and update (EngineCore checks them)."""
    max_len = 48
    num_blocks = -(-max_len // block_size) + 1 + extra_blocks  # one max-length sequence always fits
    engine, worker = make_engine(
        num_blocks=num_blocks,
        block_size=block_size,
        vocab=VOCAB,
        max_model_len=max_len,
        max_num_batched_tokens=budget,
        max_num_seqs=8,
        speculative=_spec(k=k, lo=1, hi=3, method=method),
    )
    engine.plans_in_flight = in_flight
    s = engine.scheduler
    live: dict[str, tuple[list[int], SamplingParams]] = {}
    aborted: set[str] = set()
    got: dict[tuple[str, int], list[int]] = {}
    finished: set[tuple[str, int]] = set()

    def collect(outputs):
        for out in outputs:
            key = (out.request_id, out.index)
            assert key not in finished, f"{key}: output after its finish"
            got.setdefault(key, []).extend(out.new_token_ids)
            if out.finish_reason is not None:
                finished.add(key)
                assert out.usage.completion_tokens == len(got[key])

    for i, (op, arg) in enumerate(ops):
        if op == "add":
            prompt, max_tokens, n, prio, stops = arg
            sp = SamplingParams(max_tokens=max_tokens, n=n, stop_token_ids=tuple(stops))
            rid = f"r{i}"
            s.add_request(rid, prompt, sp, priority=prio)
            live[rid] = (prompt, sp)
        elif op == "step":
            for _ in range(arg):
                collect(engine.step())
        elif op == "abort" and s.requests:
            rid = sorted(s.requests)[arg % len(s.requests)]
            collect(s.abort_request(rid))
            aborted.add(rid)
        elif op == "worker_lost":
            engine._in_flight.clear()  # what the served loop does: plans in flight die with it
            s.on_worker_lost()
            worker.reset()
            check_scheduler(s)
    for _ in range(5000):
        if not engine.has_work():
            break
        collect(engine.step())
    check_all_free(s)
    assert not worker.tables
    for rid, (prompt, sp) in live.items():
        for idx in range(sp.n):
            ref = reference_tokens(prompt, idx, sp.max_tokens, VOCAB, frozenset(sp.stop_token_ids))
            toks = got.get((rid, idx), [])
            if rid in aborted:
                assert toks == ref[: len(toks)]
            else:
                assert toks == ref, (rid, idx)


@pytest.mark.parametrize("in_flight", [1, 2])
def test_speculation_accepts_and_rejects_on_a_repetitive_workload(in_flight):
    """Both paths run for real (the property test above cannot assert that per example), the
    tokens equal the reference, and speculation took fewer steps than plain decoding (one
    stream: the plans its verifies sit out are empty, never sent nor counted)."""
    steps = {}
    for method in ("", "ngram", "draft"):
        engine, _ = make_engine(
            num_blocks=128,
            block_size=2,
            vocab=VOCAB,
            max_model_len=200,
            speculative=_spec(k=4, lo=1, hi=4, method=method) if method else SpeculativeConfig(),
        )
        engine.plans_in_flight = in_flight
        prompt = [0, 1, 2, 3] * 4
        engine.add_request("r", prompt, SamplingParams(max_tokens=100))
        tokens = engine.run_to_completion()
        assert tokens[("r", 0)] == reference_tokens(prompt, 0, 100, VOCAB)
        steps[method] = engine.scheduler.num_steps
        check_all_free(engine.scheduler)
        if method:
            stats = engine.scheduler.speculator.stats
            assert 0 < stats.num_accepted < stats.num_proposed, stats
    assert steps["ngram"] < steps[""] and steps["draft"] < steps[""], steps


def test_serve_forwards_the_speculative_flags_to_the_control_plane(tmp_path):
    from pagedkv.cli import build_parser
    from pagedkv.processes import scheduler_config_from_args
    from pagedkv.serve import child_commands

    p = build_parser()
    args = p.parse_args("serve --speculative ngram --num-speculative-tokens 5 --prompt-lookup-max 6".split())
    _, control, _ = child_commands(args, tmp_path)
    config = scheduler_config_from_args(p.parse_args(control[control.index("control") :]))
    assert config.speculative == SpeculativeConfig("ngram", 5, 2, 6)
    assert scheduler_config_from_args(p.parse_args(["control"])).speculative.method == ""


def test_serve_pairs_speculative_draft_with_the_workers_draft_model(tmp_path):
    from pagedkv.cli import build_parser
    from pagedkv.processes import scheduler_config_from_args, worker_config_from_args
    from pagedkv.serve import child_commands

    p = build_parser()
    args = p.parse_args(
        "serve --speculative draft --draft-model /models/small --num-speculative-tokens 4".split()
    )
    worker, control, _ = child_commands(args, tmp_path)
    assert (
        worker_config_from_args(p.parse_args(worker[worker.index("worker") :])).draft_model == "/models/small"
    )
    config = scheduler_config_from_args(p.parse_args(control[control.index("control") :]))
    assert (config.speculative.method, config.speculative.num_speculative_tokens) == ("draft", 4)
    from control_plane.sim_worker import SimWorker
    from pagedkv.serve import _forward_line

    assert "draft model sim-draft, a pool of the same 64 blocks" in _forward_line(SimWorker().describe())
    with pytest.raises(ValueError, match="needs --draft-model"):
        child_commands(p.parse_args("serve --speculative draft".split()), tmp_path)
    with pytest.raises(ValueError, match="--speculative draft only"):
        child_commands(p.parse_args("serve --speculative ngram --draft-model /m".split()), tmp_path)


def test_a_worker_without_a_draft_model_turns_draft_speculation_off():
    from dataclasses import replace

    from control_plane.scheduler import Scheduler
    from control_plane.scheduler_config import SchedulerConfig
    from control_plane.sim_worker import SimWorker

    info = SimWorker().describe()
    config = SchedulerConfig(speculative=_spec(method="draft"))
    assert Scheduler(config, info).speculator is not None
    assert Scheduler(config, replace(info, draft_model="")).speculator is None


def test_pagedkv_stats_shows_the_speculation_counters():
    from base.v1 import engine_pb2
    from pagedkv.commands import stats_rows

    off = dict(stats_rows(engine_pb2.EngineStats()))
    assert not any(name.startswith("spec") for name in off)
    s = engine_pb2.EngineStats(
        spec_num_verifies=4,
        spec_num_proposed=10,
        spec_num_accepted=6,
        spec_acceptance_per_position=[0.75, 0.5],
    )
    rows = dict(stats_rows(s))
    assert rows["spec proposed / accepted"] == "10 / 6  (60.0%)"
    assert rows["spec accepted per position"] == "75% 50%"
    assert rows["spec mean accepted"] == "1.50 per verify step"
