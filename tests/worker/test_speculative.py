"""Speculative decoding through the real scheduler and the real CPU worker: greedy and seeded
sampled tokens with n-gram speculation are exactly those without it (tiny test models, fused
and reference forwards, and the random default model), under preemption, n > 1, stop ids,
aborts and 1 or 2 plans in flight; sampled acceptance has the target distribution (a
chi-square test); the worker refuses verify plans it cannot roll back."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from base.plan import ContinuingSequence, NewSequence, Plan, SamplingParams
from control_plane.engine import EngineCore
from control_plane.invariants import check_all_free
from control_plane.scheduler_config import SchedulerConfig
from control_plane.speculation import SpeculativeConfig
from tests.worker.worker_test_utils import make_worker
from worker import Worker, WorkerConfig
from worker.errors import PlanError
from worker.sampler import Sampler, SamplingRow
from worker.speculative_verify import sequence_outputs

NGRAM = SpeculativeConfig("ngram", num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3)


def run(
    worker, requests, spec: bool | SpeculativeConfig | None, in_flight: int = 1, aborts=(), **cfg
) -> tuple[dict, EngineCore]:
    """`requests`: (id, prompt, SamplingParams); `aborts`: (step, id) pairs; `spec`: a
    speculation config, or True for NGRAM. Returns ((request id, index) -> (tokens, finish
    reason), the engine); invariants checked after every step."""
    if not isinstance(spec, SpeculativeConfig):
        spec = NGRAM if spec else SpeculativeConfig()
    config = SchedulerConfig(speculative=spec, **cfg)
    engine = EngineCore(worker, config, check_invariants=True, plans_in_flight=in_flight)
    for rid, prompt, sampling in requests:
        engine.add_request(rid, prompt, sampling)
    tokens: dict = {}
    reasons: dict = {}
    step = 0
    while engine.has_work():
        for when, rid in aborts:
            if when == step and rid in engine.scheduler.requests:
                for out in engine.scheduler.abort_request(rid):
                    reasons[(out.request_id, out.index)] = out.finish_reason
        for out in engine.step():
            key = (out.request_id, out.index)
            assert key not in reasons, f"{key}: output after its finish"
            tokens.setdefault(key, []).extend(out.new_token_ids)
            if out.finish_reason is not None:
                reasons[key] = out.finish_reason
                assert out.usage.completion_tokens == len(tokens[key])
        step += 1
        assert step < 2000
    check_all_free(engine.scheduler)
    assert worker.num_sequences == 0
    return {k: (v, reasons.get(k)) for k, v in tokens.items()}, engine


def workload(vocab: int):
    """Prompts with repeats (so the lookup proposes), greedy, n = 2, a stop id, lengths that
    cross many blocks."""

    def pattern(seed, n):
        return [(seed * 7 + i * 3) % vocab for i in range(n)]

    return [
        ("a", pattern(1, 6) * 3, SamplingParams(max_tokens=40, ignore_eos=True)),
        ("b", pattern(2, 5) * 2, SamplingParams(max_tokens=30, n=2, ignore_eos=True)),
        (
            "c",
            pattern(3, 4) * 4,
            SamplingParams(max_tokens=35, ignore_eos=True, stop_token_ids=(pattern(3, 4)[2],)),
        ),
        ("d", pattern(4, 8) * 2, SamplingParams(max_tokens=25, ignore_eos=True, temperature=1.0, seed=5)),
    ]


@pytest.mark.parametrize(
    "name,kernels",
    [
        ("qwen3-head-dim-tied", "fast"),
        ("qwen3-head-dim-tied", "reference"),
        ("llama-gqa-derived-head-dim", "fast"),
    ],
)
def test_greedy_tokens_with_speculation_equal_plain_decoding(checkpoint, name, kernels):
    _, path = checkpoint(name)
    reqs = workload(128)
    baseline, _ = run(make_worker(path, block_size=4, num_blocks=256, cpu_kernels=kernels), reqs, False, 1)
    for in_flight in (1, 2):
        worker = make_worker(path, block_size=4, num_blocks=256, cpu_kernels=kernels)
        got, engine = run(worker, reqs, True, in_flight)
        assert got == baseline, in_flight
        stats = engine.scheduler.speculator.stats
        assert stats.num_verifies > 0, stats
        if name.startswith("qwen3"):  # (this tiny llama's greedy output never copies its prompt)
            assert 0 < stats.num_accepted < stats.num_proposed, stats


def test_speculation_under_preemption_and_aborts(checkpoint):
    """A pool one long sequence fills: verifies are preempted, recomputed and rolled back."""
    _, path = checkpoint("qwen3-head-dim-tied")
    reqs = workload(128)
    aborts = ((9, "d"), (14, "b"))
    baseline, _ = run(make_worker(path, block_size=2, num_blocks=256), reqs, False, 1, aborts)
    for in_flight in (1, 2):
        worker = make_worker(path, block_size=2, num_blocks=34)
        got, engine = run(worker, reqs, True, in_flight, aborts)
        assert engine.scheduler.num_preemptions > 0
        for key, (tokens, reason) in baseline.items():
            other, other_reason = got[key]
            if key[0] in ("b", "d"):  # aborted at the same step, maybe at another point
                short, long_ = sorted((tokens, other), key=len)
                assert long_[: len(short)] == short, key
            else:
                assert (other, other_reason) == (tokens, reason), (key, in_flight)


def test_default_model_greedy_tokens_equal_with_speculation():
    """The embedded random default model (512 byte tokens, 4 layers, fused CPU forward)."""
    prompt = list(b"the cat sat on the mat; the cat sat on the mat; the cat sat on the")
    reqs = [("r", prompt, SamplingParams(max_tokens=48, ignore_eos=True))]
    baseline, _ = run(Worker(WorkerConfig(num_blocks=64)), reqs, False, 1)
    got, engine = run(Worker(WorkerConfig(num_blocks=64)), reqs, True, 2)
    assert got == baseline
    assert engine.scheduler.speculator.stats.num_verifies > 0


def test_worker_refuses_a_verify_it_cannot_roll_back(checkpoint):
    _, path = checkpoint("qwen3-head-dim-tied")
    worker = make_worker(path, block_size=4, num_blocks=64)
    penalized = SamplingParams(temperature=1.0, seed=1, repetition_penalty=1.2)
    worker.execute(Plan(1, new=[NewSequence(1, [1, 2], [5, 6, 7], 0, penalized, True)]))

    def verify(**kw):
        fields = dict(token_ids=[8, 9, 10], start_pos=3, sample=True, num_speculative_tokens=2) | kw
        return Plan(2, continuing=[ContinuingSequence(1, [], [], **fields)])

    with pytest.raises(PlanError, match="no penalties"):
        worker.execute(verify())
    with pytest.raises(PlanError, match="num_speculative_tokens"):
        worker.execute(verify(num_speculative_tokens=3))
    with pytest.raises(PlanError, match="samples once per input"):
        worker.execute(verify(sample=False))


def test_worker_rolls_its_mirror_back_to_the_kept_tokens(checkpoint):
    """Proposals that are certainly wrong (a token the greedy sample is not): one token back,
    positions and table cut to it; a plain decode then continues from there."""
    _, path = checkpoint("qwen3-head-dim-tied")
    worker = make_worker(path, block_size=2, num_blocks=64)
    greedy = SamplingParams()
    (first,) = worker.execute(Plan(1, new=[NewSequence(1, [1, 2], [5, 6, 7], 0, greedy, True)])).outputs
    t = first.token_ids[0]
    (plain,) = worker.execute(Plan(2, continuing=[ContinuingSequence(1, [3], [], [t], 3, True)])).outputs
    wrong = (plain.token_ids[0] + 1) % 128
    worker2 = make_worker(path, block_size=2, num_blocks=64)
    worker2.execute(Plan(1, new=[NewSequence(1, [1, 2], [5, 6, 7], 0, greedy, True)]))
    plan = Plan(
        2, continuing=[ContinuingSequence(1, [3, 4], [], [t, wrong, 9], 3, True, num_speculative_tokens=2)]
    )
    (out,) = worker2.execute(plan).outputs
    assert out.token_ids == plain.token_ids  # nothing accepted: the plain decode's token
    assert worker2.block_table(1) == (1, 2)  # positions 0..3 kept: blocks 3 and 4 dropped
    assert worker2.mirrors[1].num_computed_tokens == 4


def test_sampled_acceptance_has_the_target_distribution():
    """Rejection sampling with point-mass (n-gram) proposals, on a 4-token vocabulary at the
    sampler: the joint law of a verify's output (how many proposals were accepted, and the
    token after them) must equal sampling each position from its target distribution.

    20,000 verifies of proposals [0, 1] over fixed rows p0, p1, p2, the worker's sampler with a
    fixed seed; chi-square over the 10 possible outputs against their exact probabilities at
    alpha = 1e-3 (9 degrees of freedom: critical value 27.88). Power: a rule off by 0.03 in the
    first acceptance probability (0.5) gives a non-centrality of ~72, detected with probability
    > 0.99."""
    p = [[0.5, 0.2, 0.2, 0.1], [0.1, 0.6, 0.2, 0.1], [0.25, 0.25, 0.25, 0.25]]
    expected = {(t,): p[0][t] for t in (1, 2, 3)}
    expected |= {(0, t): p[0][0] * p[1][t] for t in (0, 2, 3)}
    expected |= {(0, 1, t): p[0][0] * p[1][1] * p[2][t] for t in range(4)}
    sampler = Sampler(seed=1234)
    params = SamplingParams(temperature=1.0)
    logits = torch.log(torch.tensor(p))
    counts: Counter = Counter()
    batch, batches = 1000, 20
    for _ in range(batches):
        rows = [SamplingRow(params, 0, 10 + i) for _ in range(batch) for i in range(3)]
        samples = sampler.sample(logits.repeat(batch, 1), rows)
        ids = [s for s in range(batch) for _ in range(3)]
        for _, out, _, kept in sequence_outputs(ids, rows, samples, {s: [0, 1] for s in range(batch)}):
            counts[tuple(out.token_ids)] += 1
            assert kept == 10 + len(out.token_ids) - 1
    total = batch * batches
    assert set(counts) <= set(expected)
    chi2 = sum((counts[k] - total * q) ** 2 / (total * q) for k, q in expected.items())
    assert chi2 < 27.88, (chi2, counts)


def test_seeded_sampled_requests_reproduce_with_speculation(checkpoint):
    """A seeded row's uniform depends on (seed, sample, position) only: with speculation a
    seeded sampled request gets the same tokens run to run and the same as without it."""
    _, path = checkpoint("qwen3-head-dim-tied")
    prompt = [3, 9, 27, 81, 3, 9, 27, 81, 3, 9, 27, 81]
    reqs = [("s", prompt, SamplingParams(max_tokens=40, ignore_eos=True, temperature=0.7, seed=11))]
    baseline, _ = run(make_worker(path, block_size=4, num_blocks=128), reqs, False, 1)
    first, engine = run(make_worker(path, block_size=4, num_blocks=128), reqs, True, 2)
    second, _ = run(make_worker(path, block_size=4, num_blocks=128), reqs, True, 2)
    assert first == second == baseline
    assert engine.scheduler.speculator.stats.num_verifies > 0
