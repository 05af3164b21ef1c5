"""Sampling: greedy = argmax, truncation never leaks, seeds are stateless and batch-independent,
the draw follows the distribution, logprobs are of the raw logits."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from base.plan import SamplingParams
from tests.worker.worker_test_utils import VOCAB, PlanDriver, make_worker
from worker.sampler import Sampler, SamplingRow, token_seed


def random_logits(rows: int, vocab: int = 64, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def row(
    params: SamplingParams, sample_index: int = 0, position: int = 10, num_samples: int = 1
) -> SamplingRow:
    return SamplingRow(params, sample_index, position, num_samples)


def test_temperature_zero_is_argmax_with_raw_logprob():
    logits = random_logits(5)
    params = SamplingParams(temperature=0.0, logprobs=True, top_k=3, top_p=0.5)
    samples = Sampler(seed=0).sample(logits, [row(params)] * 5)
    expected = logits.argmax(dim=-1)
    assert [s.token_ids for s in samples] == [[t] for t in expected.tolist()]
    log_probs = torch.log_softmax(logits, dim=-1)
    for i, s in enumerate(samples):
        assert s.logprobs == pytest.approx([log_probs[i, expected[i]].item()])


@pytest.mark.parametrize("top_k", [1, 2, 5])
def test_top_k_never_emits_outside_the_k_largest(top_k):
    logits = random_logits(8, seed=1)
    allowed = [set(r.topk(top_k).indices.tolist()) for r in logits]
    sampler = Sampler(seed=0)
    for seed in range(40):
        params = SamplingParams(temperature=2.0, top_k=top_k, seed=seed)
        for i, s in enumerate(sampler.sample(logits, [row(params)] * 8)):
            assert s.token_ids[0] in allowed[i]


@pytest.mark.parametrize("top_p", [0.05, 0.3, 0.8])
def test_top_p_never_emits_outside_the_nucleus(top_p):
    logits = random_logits(8, seed=2)
    sampler = Sampler(seed=0)
    for logit_row in logits:
        probs, order = torch.softmax(logit_row.double(), dim=-1).sort(descending=True)
        before = torch.cumsum(probs, dim=-1) - probs
        nucleus = set(order[before < top_p].tolist())
        emitted = set()
        for seed in range(60):
            params = SamplingParams(temperature=1.0, top_p=top_p, seed=seed)
            emitted.update(sampler.sample(logit_row[None], [row(params)])[0].token_ids)
        assert emitted <= nucleus
        assert len(nucleus) == 1 or len(emitted) > 1  # it does sample, not just take the top


def test_draws_follow_the_softmax_distribution():
    logits = torch.tensor([[0.0, 1.0, 2.0, -1.0]])
    expected = torch.softmax(logits[0] / 0.7, dim=-1)
    sampler = Sampler(seed=0)
    draws = 4000
    counts = Counter(
        sampler.sample(logits, [row(SamplingParams(temperature=0.7, seed=s))])[0].token_ids[0]
        for s in range(draws)
    )
    for token in range(4):
        # 5 standard deviations of a binomial: fails only if the sampler is biased.
        p = expected[token].item()
        assert abs(counts[token] / draws - p) <= 5 * (p * (1 - p) / draws) ** 0.5


def test_seeded_rows_are_independent_of_batch_order_and_composition():
    logits = random_logits(6, seed=3)
    params = [SamplingParams(temperature=1.0, top_p=0.9, seed=100 + i) for i in range(6)]
    rows = [row(p, sample_index=i % 2, position=20 + i) for i, p in enumerate(params)]
    alone = [Sampler(seed=1).sample(logits[i : i + 1], [rows[i]])[0].token_ids for i in range(6)]
    order = [4, 1, 5, 0, 3, 2]
    shuffled = Sampler(seed=2).sample(logits[order], [rows[i] for i in order])
    assert [s.token_ids for s in shuffled] == [alone[i] for i in order]


def test_seed_stream_depends_on_sample_index_and_position():
    assert token_seed(1, 0, 5) != token_seed(1, 1, 5)
    assert token_seed(1, 0, 5) != token_seed(1, 0, 6)
    assert token_seed(1, 0, 5) != token_seed(2, 0, 5)
    assert token_seed(2**64 - 1, 3, 4) < 2**63  # a valid torch seed even for the largest uint64 seed


def test_fan_out_sample_k_equals_a_row_with_sample_index_k():
    logits = random_logits(1, vocab=512, seed=4)
    params = SamplingParams(temperature=1.5, seed=9)
    fanned = Sampler(seed=0).sample(logits, [row(params, sample_index=0, num_samples=4)])[0].token_ids
    single = [Sampler(seed=0).sample(logits, [row(params, sample_index=k)])[0].token_ids[0] for k in range(4)]
    assert fanned == single
    assert len(set(fanned)) > 1  # independent draws, not one token repeated


def test_unseeded_rows_use_the_worker_generator():
    logits = torch.zeros(1, 512)
    params = SamplingParams(temperature=1.0)
    first, second = Sampler(seed=5), Sampler(seed=5)
    draws = [first.sample(logits, [row(params)])[0].token_ids[0] for _ in range(10)]
    assert len(set(draws)) > 1
    assert draws == [second.sample(logits, [row(params)])[0].token_ids[0] for _ in range(10)]


def test_logprobs_are_of_raw_logits_whatever_the_temperature():
    logits = random_logits(1, seed=5)
    params = SamplingParams(temperature=3.0, top_k=4, seed=1, logprobs=True)
    sample = Sampler(seed=0).sample(logits, [row(params)])[0]
    assert sample.logprobs == pytest.approx([torch.log_softmax(logits[0], -1)[sample.token_ids[0]].item()])


def test_seeded_generation_is_batch_and_preemption_independent(checkpoint):
    """End to end: a seeded request's tokens do not depend on its batch neighbours, their
    order, or on being preempted and recomputed."""
    _, path = checkpoint("qwen3-head-dim-tied")
    rng = random.Random(11)
    target_prompt = [rng.randrange(VOCAB) for _ in range(9)]
    others = [[rng.randrange(VOCAB) for _ in range(n)] for n in (4, 13)]
    seeded = SamplingParams(temperature=1.0, top_k=40, seed=1234)
    noisy = SamplingParams(temperature=1.0)

    def run(neighbours: list[int], preempt_after: int | None = None) -> list[int]:
        driver = PlanDriver(make_worker(path, block_size=4))
        target = driver.add(7, target_prompt, sampling=seeded)
        for seq_id in neighbours:
            driver.add(seq_id, others[seq_id - 1], sampling=noisy)
        order = dict.fromkeys([*neighbours[:1], 7, *neighbours[1:]])
        for step in range(8):
            if step == preempt_after:
                target.table, target.computed, target.registered = [], 0, False
                driver.step({}, finished=[7])
            driver.step(order)
        return target.generated

    alone = run([])
    assert len(set(alone)) > 1
    assert run([1, 2]) == alone
    assert run([2, 1]) == alone
    assert run([1], preempt_after=4) == alone


def _mixed_rows(rng: random.Random, count: int) -> list[SamplingRow]:
    """Every sampling mode at once: greedy, temperature alone, top-k, top-p, both, k >= vocab,
    seeded and unseeded, fan-outs, logprobs on some."""
    rows = []
    for i in range(count):
        params = SamplingParams(
            temperature=rng.choice([0.0, 0.5, 1.0, 2.5]),
            top_k=rng.choice([0, 0, 1, 7, 50, 5000]),
            top_p=rng.choice([1.0, 1.0, 0.9, 0.3]),
            seed=rng.choice([None, rng.randrange(1 << 40)]),
            logprobs=rng.random() < 0.5,
        )
        rows.append(
            row(params, sample_index=rng.randrange(3), position=i + 5, num_samples=rng.choice([1, 1, 3]))
        )
    return rows


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("vocab, scale", [(1000, 1.0), (5000, 3.0), (5000, 0.05)])
def test_batched_sampler_equals_the_per_row_reference(seed, vocab, scale):
    """The batched sampler (the worker's, on any device) draws exactly the reference's tokens
    for the same uniforms, in every mode mixed in one batch, and the same logprobs. At vocab
    5000 top-p looks for the nucleus among the 1024 largest first: peaked logits find it
    there, near-flat ones (scale 0.05) need the full sort."""
    from worker.reference_sampler import ReferenceSampler

    rng = random.Random(seed)
    rows = _mixed_rows(rng, 24)
    logits = random_logits(len(rows), vocab=vocab, seed=seed) * scale
    batched = Sampler(seed=seed).sample(logits, rows)
    reference = ReferenceSampler(seed=seed).sample(logits, rows)
    assert [s.token_ids for s in batched] == [s.token_ids for s in reference]
    for b, r in zip(batched, reference, strict=True):
        assert (b.logprobs is None) == (r.logprobs is None)
        if b.logprobs is not None:
            assert b.logprobs == pytest.approx(r.logprobs, abs=1e-5)


def test_top_p_draws_follow_the_renormalized_nucleus():
    """A distribution check of the truncated path with a fixed seed stream: over many seeded
    positions the kept tokens' frequencies match their renormalized probabilities."""
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0, -2.0]])
    params = SamplingParams(temperature=1.0, top_p=0.8, seed=77)
    probs = torch.softmax(logits[0].double(), -1)
    kept = 2 if probs[:2].sum() >= 0.8 else 3
    nucleus = probs[:kept] / probs[:kept].sum()
    sampler, draws = Sampler(seed=0), 4000
    counts = Counter(sampler.sample(logits, [row(params, position=p)])[0].token_ids[0] for p in range(draws))
    assert set(counts) <= set(range(kept))
    for token in range(kept):
        assert counts[token] / draws == pytest.approx(float(nucleus[token]), abs=0.03)
