"""The worker's greedy output equals Hugging Face transformers' generate() exactly, and its
logits agree within 1e-4 (relative), however the tokens are split into plans: block sizes
1/4/16, chunked prefill, mixed prefill+decode batches, prefix-cache hits, copy-on-write
forks, and preemption by recompute. The default (fast) CPU forward runs every scenario; the
first two also run on the reference forward, the oracle the fast one replaced."""

from __future__ import annotations

import random

import pytest

from base.plan import ContinuingSequence, NewSequence, Plan
from tests.worker.worker_test_utils import (
    CHECKPOINTS,
    GREEDY,
    VOCAB,
    PlanDriver,
    assert_logits_close,
    hf_greedy,
    hf_logits,
    make_worker,
)

BLOCK_SIZES = [1, 4, 16]
CPU_KERNELS = ["fast", "reference"]
SCENARIO_MODELS = ["qwen3-head-dim-tied", "qwen2-mqa-bias", "llama-gqa-derived-head-dim"]


def prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB) for _ in range(length)]


def check_against_hf(hf_model, seq, prompt_len: int) -> None:
    """Generated tokens == generate(); every sampled step's logits match a full HF forward."""
    assert seq.generated == hf_greedy(hf_model, seq.tokens[:prompt_len], len(seq.generated))
    reference = hf_logits(hf_model, seq.tokens[:-1])
    first = len(seq.tokens) - 1 - len(seq.logits)
    for k, row in enumerate(seq.logits):
        assert_logits_close(row, reference[first + k])


@pytest.mark.parametrize("cpu_kernels", CPU_KERNELS)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_greedy_generation_matches_transformers(checkpoint, name, block_size, cpu_kernels):
    hf_model, path = checkpoint(name)
    driver = PlanDriver(make_worker(path, block_size, cpu_kernels=cpu_kernels))
    seq = driver.add(1, prompt(21, seed=1))
    driver.step({1: None})
    driver.decode([1], 9)
    assert len(seq.generated) == 10
    check_against_hf(hf_model, seq, 21)


@pytest.mark.parametrize("cpu_kernels", CPU_KERNELS)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("name", SCENARIO_MODELS)
def test_chunked_prefill(checkpoint, name, block_size, cpu_kernels):
    hf_model, path = checkpoint(name)
    driver = PlanDriver(make_worker(path, block_size, cpu_kernels=cpu_kernels))
    seq = driver.add(1, prompt(23, seed=2))
    for chunk in (5, 9, 2):
        result = driver.step({1: chunk})
        assert result.outputs == []  # a non-final chunk samples nothing
    driver.step({1: 7})
    driver.decode([1], 5)
    check_against_hf(hf_model, seq, 23)


@pytest.mark.parametrize("name", SCENARIO_MODELS)
def test_batch_mixing_prefill_and_decode(checkpoint, name):
    hf_model, path = checkpoint(name)
    driver = PlanDriver(make_worker(path, block_size=4))
    a = driver.add(1, prompt(13, seed=3))
    b = driver.add(2, prompt(19, seed=4))
    c = driver.add(3, prompt(6, seed=5))
    driver.step({1: None})
    driver.step({1: None, 2: 10})  # A decodes while B prefills its first chunk
    driver.step({2: None, 1: None, 3: None})  # B's last chunk, A decodes, C's whole prompt
    driver.decode([3, 1, 2], 5)
    for seq, prompt_len in ((a, 13), (b, 19), (c, 6)):
        check_against_hf(hf_model, seq, prompt_len)


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_prefix_cache_hit_starts_mid_prompt(checkpoint, block_size):
    hf_model, path = checkpoint("qwen3-head-dim-tied")
    driver = PlanDriver(make_worker(path, block_size))
    shared = prompt(16, seed=6)  # 16 tokens = whole blocks at every block size tested
    first = driver.add(1, shared + prompt(5, seed=7))
    driver.step({1: None})
    driver.decode([1], 2)
    num_shared_blocks = 16 // block_size
    # Seq 2's table starts with seq 1's full prompt blocks; only its own suffix is computed.
    second = driver.add(2, shared + prompt(7, seed=8), table=first.table[:num_shared_blocks], computed=16)
    result = driver.step({2: None, 1: None})
    assert [o.seq_id for o in result.outputs] == [1, 2]  # the worker runs decodes first
    driver.decode([1, 2], 4)
    assert (
        driver.worker.block_table(2)[:num_shared_blocks] == driver.worker.block_table(1)[:num_shared_blocks]
    )
    check_against_hf(hf_model, first, 21)
    check_against_hf(hf_model, second, 23)


def _forked_pair(driver: PlanDriver, parent_prompt: list[int]):
    """Prefill a parent with num_samples=2 and return (parent, both sampled tokens)."""
    parent = driver.add(1, parent_prompt, num_samples=2)
    result = driver.step({1: None})
    fanned_out = result.outputs[0].token_ids
    assert len(fanned_out) == 2 and fanned_out[0] == fanned_out[1]  # greedy: both samples agree
    return parent, fanned_out[0]


@pytest.mark.parametrize("cow_side", ["child_table", "parent_replaced"])
def test_fork_after_copy_on_write(checkpoint, cow_side):
    """Parent and child share the partially filled last prompt block; the child continues with
    a different token than the parent, so a missing or wrong copy corrupts one of them."""
    hf_model, path = checkpoint("qwen2-mqa-bias")
    driver = PlanDriver(make_worker(path, block_size=4))
    parent_prompt = prompt(14, seed=9)  # 3 full blocks + 2 tokens in the 4th
    parent, token = _forked_pair(driver, parent_prompt)
    child_token = (token + 1) % VOCAB
    shared_last, fresh = parent.table[-1], driver.alloc()
    parent.tokens.append(token)
    parent.generated.append(token)
    if cow_side == "child_table":
        child_table, parent_replaced = parent.table[:-1] + [fresh], []
    else:
        child_table, parent_replaced = list(parent.table), [(len(parent.table) - 1, fresh)]
        parent.table[-1] = fresh
    child = driver.add(2, parent_prompt + [child_token], table=child_table, sample_index=1)
    plan = Plan(
        step_id=100,
        new=[NewSequence(2, child_table, [child_token], 14, GREEDY, True, sample_index=1)],
        continuing=[ContinuingSequence(1, [], parent_replaced, [token], 14, True)],
        copies=[(shared_last, fresh)],
    )
    driver.execute(plan)
    parent.computed = child.computed = 15
    child.registered = True
    driver.decode([1, 2], 4)
    assert parent.tokens[:15] == parent_prompt + [token]
    check_against_hf(hf_model, parent, 14)
    assert child.generated == hf_greedy(hf_model, parent_prompt + [child_token], len(child.generated))
    reference = hf_logits(hf_model, child.tokens[:-1])
    for k, row in enumerate(child.logits):
        assert_logits_close(row, reference[14 + k])


def test_preempted_sequence_recomputes_identically(checkpoint):
    hf_model, path = checkpoint("llama-gqa-derived-head-dim")
    driver = PlanDriver(make_worker(path, block_size=4))
    seq = driver.add(1, prompt(10, seed=10))
    driver.step({1: None})
    driver.decode([1], 3)
    # Preempt: the control plane frees its blocks; it comes back as new with a fresh table.
    seq.table, seq.computed, seq.registered = [], 0, False
    driver.step({}, finished=[1])
    assert driver.worker.num_sequences == 0
    driver.step({1: 6})
    driver.step({1: None})
    driver.decode([1], 3)
    check_against_hf(hf_model, seq, 10)
