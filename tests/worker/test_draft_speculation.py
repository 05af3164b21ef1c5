"""Draft-model speculation (`--speculative draft`, worker/draft_model.py) through the real
scheduler and CPU worker: greedy tokens equal plain decoding's (a truncated draft and the
target as its own draft, fused and reference forwards, 1 and 2 plans in flight, preemption,
aborts, n > 1, stop ids); the draft pool stays exact (target-as-draft keeps ~100 % acceptance
through prefix hits, copy-on-write and recompute); seeded sampled requests reproduce; the
rejection rule with a real q gives the target distribution (chi-square); refusals."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from base.plan import ContinuingSequence, NewSequence, Plan, SamplingParams
from control_plane.engine import EngineCore
from control_plane.scheduler_config import SchedulerConfig
from control_plane.speculation import SpeculativeConfig
from tests.worker.test_speculative import run
from tests.worker.worker_test_utils import make_worker
from worker.draft_acceptance import Uniforms, accept_sampled, draw, probabilities
from worker.draft_checkpoint import truncate_checkpoint
from worker.errors import PlanError, WorkerConfigError
from worker.reference_sampler import truncated_cdf
from worker.sampler import SamplingRow

TARGET = "qwen3-head-dim-tied"


def draft_config(k: int = 3) -> SpeculativeConfig:
    return SpeculativeConfig("draft", num_speculative_tokens=k, max_batch_size=16)


@pytest.fixture(scope="module")
def models(checkpoint, tmp_path_factory):
    """(target dir, its 1-layer truncation): a draft that agrees sometimes."""
    _, path = checkpoint(TARGET)
    return path, truncate_checkpoint(path, tmp_path_factory.mktemp("draft") / "d", 1)


def greedy_workload():
    """Shared prefixes (prefix-cache hits), n = 2 (a fork: copy-on-write), a stop id, lengths
    that cross many blocks."""
    shared = [7, 3, 9, 1, 4, 4, 8, 2, 6, 5]
    return [
        ("a", shared + [11, 12], SamplingParams(max_tokens=40, ignore_eos=True)),
        ("b", shared + [13], SamplingParams(max_tokens=30, n=2, ignore_eos=True)),
        ("c", [5, 6, 7, 8] * 3, SamplingParams(max_tokens=35, ignore_eos=True, stop_token_ids=(17,))),
    ]


def stats_of(engine):
    return engine.scheduler.speculator.stats


@pytest.mark.parametrize("kernels", ["fast", "reference"])
def test_greedy_tokens_with_a_draft_equal_plain_decoding(models, kernels):
    target, draft = models
    reqs = greedy_workload()
    baseline, _ = run(make_worker(target, block_size=4, num_blocks=256, cpu_kernels=kernels), reqs, None)
    for in_flight, k in ((1, 3), (2, 4), (1, 1)):
        worker = make_worker(
            target, block_size=4, num_blocks=256, cpu_kernels=kernels, draft_model=str(draft)
        )
        got, engine = run(worker, reqs, draft_config(k), in_flight)
        assert got == baseline, (in_flight, k)
        stats = stats_of(engine)
        assert 0 < stats.num_accepted < stats.num_proposed, stats  # both outcomes ran


@pytest.mark.parametrize("in_flight", [1, 2])
def test_the_target_as_its_own_draft_is_accepted_throughout(models, in_flight):
    """fp32, the draft = the target: every proposal is the target's own greedy token, so
    acceptance is ~100 % -- which holds only if the draft pool holds the right K/V at every
    position: after prefix-cache hits, the fork's copy-on-write (both pools' blocks copied),
    and catch-up of fully accepted runs. (Not exactly 100 %: the draft computes a position in
    a one-row pass, the target in a (1 + k)-row one; a near-tie may round apart.)"""
    target, _ = models
    reqs = greedy_workload()
    baseline, _ = run(make_worker(target, block_size=4, num_blocks=256), reqs, None)
    worker = make_worker(target, block_size=4, num_blocks=256, draft_model=str(target))
    got, engine = run(worker, reqs, draft_config(4), in_flight)
    assert got == baseline
    stats = stats_of(engine)
    assert stats.num_verifies > 10 and stats.acceptance_rate >= 0.97, stats
    assert engine.scheduler.kv.prefix_hits > 0  # "b" hit "a"'s prefix blocks, in both pools


def test_draft_speculation_under_preemption_and_aborts(models):
    """A pool one long sequence fills: draft verifies are preempted, recomputed (the draft's
    K/V recomputed with the target's) and rolled back; aborted requests end mid-run."""
    target, draft = models
    reqs = greedy_workload()
    aborts = ((9, "b"),)
    baseline, _ = run(make_worker(target, block_size=2, num_blocks=256), reqs, None, 1, aborts)
    for in_flight, own in ((1, False), (2, False), (2, True)):
        worker = make_worker(target, block_size=2, num_blocks=30, draft_model=str(target if own else draft))
        got, engine = run(worker, reqs, draft_config(3), in_flight, aborts)
        assert engine.scheduler.num_preemptions > 0
        for key, (tokens, reason) in baseline.items():
            other, other_reason = got[key]
            if key[0] == "b":  # aborted at the same step, maybe at another point
                short, long_ = sorted((tokens, other), key=len)
                assert long_[: len(short)] == short, key
            else:
                assert (other, other_reason) == (tokens, reason), (key, in_flight)
        if own:
            assert stats_of(engine).acceptance_rate >= 0.97, stats_of(engine)


def test_seeded_sampled_requests_reproduce_with_a_draft(models):
    """Sampled draft verifies (the rejection rule with q): a seeded request gets the same
    tokens run to run, whatever else runs beside it."""
    target, draft = models
    seeded = (
        "s",
        [3, 9, 27, 81] * 3,
        SamplingParams(max_tokens=40, ignore_eos=True, temperature=0.8, seed=11),
    )
    other = ("o", [1, 2, 3], SamplingParams(max_tokens=20, ignore_eos=True))
    outs = []
    for reqs in ([seeded], [seeded], [other, seeded]):
        worker = make_worker(target, block_size=4, num_blocks=128, draft_model=str(draft))
        got, engine = run(worker, reqs, draft_config(3), 2)
        outs.append(got[("s", 0)])
        assert stats_of(engine).num_verifies > 0
    assert outs[0] == outs[1] == outs[2]


def test_probabilities_match_the_sampler_oracle():
    """The dense distribution the rule uses is the one the sampler draws from."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 50, generator=gen) * 3
    params = [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.5, top_k=7),
        SamplingParams(temperature=1.3, top_p=0.8),
        SamplingParams(temperature=0.9, top_k=10, top_p=0.6),
        SamplingParams(temperature=2.0, top_k=1),
        SamplingParams(temperature=0.7, top_p=0.05),
    ]
    got = probabilities(logits, params)
    for i, p in enumerate(params):
        ids, cdf = truncated_cdf(logits[i], p)
        mass = torch.diff(cdf, prepend=torch.zeros(1)) / cdf[-1]
        want = torch.zeros(50, dtype=torch.float64)
        want[ids] = mass.double()
        assert torch.allclose(got[i], want, atol=1e-6), i


def test_sampled_acceptance_with_a_real_q_has_the_target_distribution():
    """The rejection rule with a non-degenerate draft q on a 4-token vocabulary, k = 2,
    20,000 verifies at a fixed seed, proposals d_i ~ q_i (the draft's draw): the first output
    token is distributed as p0, the second (after an accepted first proposal) as p1, and the
    first proposal's acceptance rate is sum_x min(p0, q0)(x) = 0.75.

    Chi-square tests at alpha = 1e-3 (3 degrees of freedom: critical value 16.27). Power: a
    rule that resamples a rejection from p instead of the residual gives P(first = 0) = 0.375
    instead of 0.5 (non-centrality > 600: detected with probability ~1); a point-mass rule
    (accept iff a draw from p equals d) gives an acceptance rate of E_q[p0(d)] = 0.25 instead
    of 0.75, outside the +-0.015 band (> 5 binomial sigmas)."""
    p = torch.tensor(
        [[0.5, 0.2, 0.2, 0.1], [0.1, 0.6, 0.2, 0.1], [0.25, 0.25, 0.25, 0.25]], dtype=torch.float64
    )
    q = torch.tensor([[0.25, 0.25, 0.25, 0.25], [0.4, 0.3, 0.2, 0.1]], dtype=torch.float64)
    params = SamplingParams(temperature=1.0)
    rows = [SamplingRow(params, 0, 10 + i) for i in range(3)]
    uniforms = Uniforms(1234)
    gen = torch.Generator().manual_seed(99)
    counts: Counter = Counter()
    first_accepted = 0
    total = 20000
    for _ in range(total):
        proposals = [draw(q[i], float(torch.rand(1, generator=gen, dtype=torch.float64))) for i in range(2)]
        bonus = draw(p[2], float(torch.rand(1, generator=gen, dtype=torch.float64)))
        out = accept_sampled(p, q, proposals, rows, bonus, uniforms)
        assert 1 <= len(out) <= 3 and out[: len(out) - 1] == proposals[: len(out) - 1]
        first_accepted += len(out) > 1
        padded = out + [None] * (3 - len(out))  # nothing follows a rejection's draw
        counts[tuple(padded)] += 1
    firsts: Counter = Counter()
    seconds: Counter = Counter()
    for key, c in counts.items():
        firsts[key[0]] += c
        if key[1] is not None:
            seconds[key[1]] += c
    for law, row in ((firsts, p[0]), (seconds, p[1])):
        n = sum(law.values())
        chi2 = sum((law[t] - n * float(row[t])) ** 2 / (n * float(row[t])) for t in range(4))
        assert chi2 < 16.27, (chi2, law)
    rate = first_accepted / total
    assert abs(rate - 0.75) < 0.015, rate


def test_worker_without_a_draft_refuses_draft_tokens_and_bad_drafts_refuse_to_start(models, checkpoint):
    target, draft = models
    worker = make_worker(target, block_size=4, num_blocks=64)
    greedy = SamplingParams()
    worker.execute(Plan(1, new=[NewSequence(1, [1, 2], [5, 6, 7], 0, greedy, True)]))
    plan = Plan(2, continuing=[ContinuingSequence(1, [], [], [8], 3, True, num_draft_tokens=2)])
    with pytest.raises(PlanError, match="--draft-model"):
        worker.execute(plan)
    drafted = make_worker(target, block_size=4, num_blocks=64, draft_model=str(draft))
    drafted.execute(Plan(1, new=[NewSequence(1, [1, 2], [5, 6, 7], 0, greedy, True)]))
    bad = Plan(2, continuing=[ContinuingSequence(1, [], [], [8, 9], 3, True, num_draft_tokens=2)])
    with pytest.raises(PlanError, match="exactly one known token"):
        drafted.execute(bad)
    _, llama = checkpoint("llama-gqa-derived-head-dim")
    with pytest.raises(WorkerConfigError, match="contiguous|paged"):
        make_worker(target, block_size=4, num_blocks=64, draft_model=str(draft), kv_layout="contiguous")
    from types import SimpleNamespace

    from worker.draft_model import load_draft

    with pytest.raises(WorkerConfigError, match="CPU worker only"):  # checked before anything loads
        load_draft(SimpleNamespace(device=torch.device("cuda")), str(draft))
    from tests.worker.test_sliding_window import WINDOWED
    from tests.worker.worker_test_utils import build_checkpoint

    mistral = target.parent / "windowed-mistral"
    if not (mistral / "config.json").is_file():
        build_checkpoint(mistral, WINDOWED["mistral"])
    with pytest.raises(WorkerConfigError, match="sliding-window"):
        make_worker(target, block_size=4, num_blocks=64, draft_model=str(mistral))
    with pytest.raises(WorkerConfigError, match="sliding-window"):
        make_worker(mistral, block_size=4, num_blocks=64, draft_model=str(target))
    assert llama  # same vocabulary: accepted as a draft (a different family is fine)
    make_worker(target, block_size=4, num_blocks=64, draft_model=str(llama))


def test_the_kv_budget_is_split_between_the_pools_and_reported(models):
    target, draft = models
    memory = 1 << 20
    plain = make_worker(target, block_size=4, num_blocks=None, kv_cache_memory=memory)
    both = make_worker(target, block_size=4, num_blocks=None, kv_cache_memory=memory, draft_model=str(draft))
    per_target = plain.kv_spec.bytes_per_block
    per_draft = both.draft.kv_cache.spec.bytes_per_block
    assert per_draft * 2 == per_target  # 1 layer of 2
    info = both.describe()
    assert info.num_blocks == memory // (per_target + per_draft) < plain.describe().num_blocks
    assert both.draft.kv_cache.reported_num_blocks == info.num_blocks
    assert (
        info.draft_model.endswith(f"(1 layers, {per_draft} bytes/block)")
        and plain.describe().draft_model == ""
    )


def test_block_copies_copy_the_draft_pool_too(models):
    target, draft = models
    worker = make_worker(target, block_size=4, num_blocks=16, draft_model=str(draft))
    greedy = SamplingParams()
    worker.execute(Plan(1, new=[NewSequence(1, [1, 2], list(range(5, 11)), 0, greedy, True)]))
    pool = worker.draft.kv_cache
    assert pool.k_caches[0][2, :2].abs().sum() > 0  # the draft's prefill wrote its K/V
    worker.execute(Plan(2, copies=[(2, 3)]))
    for layer in range(len(pool.k_caches)):
        assert torch.equal(pool.k_caches[layer][3], pool.k_caches[layer][2])
        assert torch.equal(pool.v_caches[layer][3], pool.v_caches[layer][2])


def test_sampled_draft_tokens_carry_the_targets_logprobs(models):
    """A sampled draft verify replaces its rows' tokens by the rule's outcome; each returned
    token's logprob must be the target's at that position for that token (checked against
    the plain target's prompt logprobs of prompt + output, fp32)."""
    target, draft = models
    prompt = [3, 9, 27, 81] * 3
    sampling = SamplingParams(max_tokens=24, ignore_eos=True, temperature=1.0, seed=4, logprobs=True)
    worker = make_worker(target, block_size=4, num_blocks=128, draft_model=str(draft))
    engine = EngineCore(worker, SchedulerConfig(speculative=draft_config(3)), check_invariants=True)
    engine.add_request("s", prompt, sampling)
    tokens, logprobs = [], []
    while engine.has_work():
        for out in engine.step():
            tokens.extend(out.new_token_ids)
            logprobs.extend(out.logprobs or [])
    assert stats_of(engine).num_verifies > 0 and len(logprobs) == len(tokens) == 24
    check = EngineCore(make_worker(target, block_size=4, num_blocks=128), SchedulerConfig())
    check.add_request("c", prompt + tokens, SamplingParams(max_tokens=1, prompt_logprobs=0))
    want = None
    while check.has_work():
        for out in check.step():
            want = out.prompt_logprobs or want
    expected = [entry.logprob for entry in want[len(prompt) :]]
    assert expected == pytest.approx(logprobs, abs=1e-4)
