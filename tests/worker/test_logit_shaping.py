"""Penalties, min_p, min_tokens, logit_bias, allowed_token_ids and top logprobs on the worker's
batched sampler, against Hugging Face's own logits processors where it has them (repetition
penalty, min_p, min_new_tokens) and against the OpenAI definitions otherwise; then end to end
through the worker with the counts kept on its mirrors (a resumed sequence and a fork too)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers.generation.logits_process import (
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
)

from base.plan import ContinuingSequence, NewSequence, Plan, SamplingParams
from tests.worker.worker_test_utils import VOCAB, make_worker
from worker.logits_shaping import shape_logits
from worker.sampler import Sampler, SamplingRow
from worker.token_counts import TokenCounts

V = 50


def counts_of(prompt: list[int], output: list[int], vocab: int = V) -> TokenCounts:
    counts = TokenCounts(vocab, len(prompt))
    counts.add(prompt + output, 0)
    return counts


def logits_for(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, V, generator=torch.Generator().manual_seed(seed)) * 3


@pytest.mark.parametrize("penalty", [0.5, 1.3, 2.0])
def test_repetition_penalty_equals_hugging_face(penalty):
    prompts = [[1, 2, 3, 3], [7, 8]]
    outputs = [[4, 1, 9], [8, 8, 20, 21]]
    logits = logits_for(2, seed=1)
    params = SamplingParams(repetition_penalty=penalty)
    rows = [SamplingRow(params, 0, 10, counts=counts_of(p, o)) for p, o in zip(prompts, outputs, strict=True)]
    got = shape_logits(logits, rows, ())
    for i, (p, o) in enumerate(zip(prompts, outputs, strict=True)):
        want = RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([p + o]), logits[i : i + 1].clone())
        torch.testing.assert_close(got[i : i + 1], want)


def test_presence_and_frequency_penalties_are_openai_over_outputs_only():
    prompt, output = [5, 6, 6], [6, 7, 7, 7]
    logits = logits_for(1, seed=2)
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    got = shape_logits(logits, [SamplingRow(params, 0, 7, counts=counts_of(prompt, output))], ())
    want = logits.clone()
    for token, count in ((6, 1), (7, 3)):  # prompt occurrences (5, 6 twice) do not count
        want[0, token] -= 0.25 * count + 0.5
    torch.testing.assert_close(got, want)


def test_logit_bias_allowed_ids_and_no_copy_when_nothing_shapes():
    logits = logits_for(3, seed=3)
    plain = SamplingRow(SamplingParams(), 0, 1)
    assert shape_logits(logits, [plain] * 3, ()) is logits  # the common step: untouched
    biased = SamplingRow(SamplingParams(logit_bias=((4, 100.0), (9, -100.0))), 0, 1)
    allowed = SamplingRow(SamplingParams(allowed_token_ids=(2, 3)), 0, 1)
    got = shape_logits(logits, [plain, biased, allowed], ())
    assert torch.equal(got[0], logits[0])
    assert got[1, 4] == logits[1, 4] + 100 and got[1, 9] == logits[1, 9] - 100
    assert torch.isinf(got[2]).sum() == V - 2 and torch.equal(got[2, 2:4], logits[2, 2:4])
    assert Sampler(0).sample(logits[1:2], [biased])[0].token_ids == [4]


@pytest.mark.parametrize("generated", [0, 2, 3, 5])
def test_min_tokens_masks_eos_and_stop_ids_like_hugging_face(generated):
    logits = logits_for(1, seed=4)
    logits[0, 11] = logits[0, 12] = 50  # the stop tokens are the most likely
    params = SamplingParams(min_tokens=3, stop_token_ids=(12,))
    row = SamplingRow(params, 0, 10 + generated, num_generated=generated)
    got = shape_logits(logits, [row], eos_token_ids=(11,))
    hf = MinNewTokensLengthLogitsProcessor(10, 3, [11, 12])
    want = hf(torch.zeros(1, 10 + generated, dtype=torch.long), logits.clone())
    torch.testing.assert_close(got, want)
    token = Sampler(0, eos_token_ids=(11,)).sample(logits, [row])[0].token_ids[0]
    assert (token in (11, 12)) == (generated >= 3)


@pytest.mark.parametrize("min_p", [0.05, 0.3])
def test_min_p_keeps_exactly_hugging_faces_tokens(min_p):
    logits = logits_for(1, seed=5)
    temperature = 0.7
    hf = MinPLogitsWarper(min_p)(None, TemperatureLogitsWarper(temperature)(None, logits.clone()))
    allowed = set(torch.nonzero(torch.isfinite(hf[0])).flatten().tolist())
    sampler = Sampler(0)
    seen = set()
    for seed in range(300):
        params = SamplingParams(temperature=temperature, min_p=min_p, seed=seed)
        seen.update(sampler.sample(logits, [SamplingRow(params, 0, 3)])[0].token_ids)
    assert seen <= allowed and len(seen) >= min(len(allowed), 2)


def test_top_logprobs_are_raw_and_shared_by_a_fan_out():
    logits = logits_for(1, seed=6)
    params = SamplingParams(temperature=1.5, seed=3, logprobs=True, top_logprobs=4, presence_penalty=2.0)
    row = SamplingRow(params, 0, 5, num_samples=3, counts=counts_of([1], [2, 3]))
    sample = Sampler(0).sample(logits, [row])[0]
    raw = torch.log_softmax(logits[0], dim=-1)
    values, ids = raw.topk(4)
    assert sample.top_ids == ids.tolist() * 3
    assert sample.top_logprobs == pytest.approx(values.tolist() * 3)
    assert sample.logprobs == pytest.approx([raw[t].item() for t in sample.token_ids])


def test_token_counts_grow_with_computed_tokens_only():
    counts = TokenCounts(V, prompt_len=3)
    counts.add([4, 4], 0)  # a first chunk of the prompt
    counts.add([9, 1, 4], 2)  # the last prompt token (9) and two generated ones
    assert counts.in_prompt[[4, 9]].all() and not counts.in_prompt[1]
    assert counts.count[1] == 1 and counts.count[4] == 1 and counts.count[9] == 0
    assert sorted(counts.ids.tolist()) == [1, 4, 9]


def _step(worker, plan: Plan):
    result, logits = worker.execute_with_logits(plan)
    return result, logits


def test_worker_penalizes_from_its_own_counts_like_a_full_history(checkpoint):
    """A sequence resumed with prefix hits (history sent) and one computed from scratch sample
    from identically penalized logits: the mirror's counts equal the history's."""
    _, path = checkpoint("qwen3-head-dim-tied")
    params = SamplingParams(repetition_penalty=1.7, frequency_penalty=0.6, presence_penalty=0.4)
    prompt, generated = [5, 6, 7, 5, 8, 9, 10, 11], [6, 6, 12]
    tokens = prompt + generated
    fresh = make_worker(path, 4)
    resumed = make_worker(path, 4)
    a, _ = _step(fresh, Plan(1, new=[NewSequence(1, [1, 2, 3], tokens, 0, params, True, prompt_len=8)]))
    # the resumed one computes only the last 3 tokens; the rest arrives as history
    _, _ = _step(resumed, Plan(1, new=[NewSequence(9, [1, 2], tokens[:8], 0, SamplingParams(), False)]))
    new = NewSequence(1, [1, 2, 3], tokens[8:], 8, params, True, prompt_len=8, history=tokens[:8])
    b, _ = _step(resumed, Plan(2, new=[new]))
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    counts = resumed.mirrors[1].counts
    assert counts.count[6] == 2 and counts.count[12] == 1 and counts.in_prompt[5] and counts.count[5] == 0


def test_worker_returns_prompt_logprobs_equal_to_a_full_forward(checkpoint):
    """Prompt logprobs over two chunks (the first ends inside the prompt: next_token), against the
    log-softmax of Hugging Face's full forward; top-k alternatives too."""
    hf, path = checkpoint("llama-gqa-derived-head-dim")
    worker = make_worker(path, 4)
    prompt = [(7 * i + 3) % VOCAB for i in range(21)]
    params = SamplingParams(prompt_logprobs=3)
    first = NewSequence(
        1, list(range(1, 7)), prompt[:12], 0, params, False, prompt_len=21, next_token=prompt[12]
    )
    r1, _ = _step(worker, Plan(1, new=[first]))
    r2, _ = _step(worker, Plan(2, continuing=[ContinuingSequence(1, [], [], prompt[12:], 12, True)]))
    entries = r1.prompt_logprobs + r2.prompt_logprobs
    assert [(e.first, len(e.logprobs)) for e in entries] == [(1, 12), (13, 8)]
    with torch.no_grad():
        table = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)
    want = [table[p - 1, prompt[p]].item() for p in range(1, 21)]
    got = [v for e in entries for v in e.logprobs]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    top = table[0].topk(3)
    assert entries[0].top_ids[:3] == top.indices.tolist()
    np.testing.assert_allclose(entries[0].top_logprobs[:3], top.values.tolist(), rtol=1e-4, atol=1e-4)
