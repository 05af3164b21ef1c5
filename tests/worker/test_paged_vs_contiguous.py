"""Paging changes where K/V live, not what is computed: the paged pool and the contiguous
baseline produce identical tokens and bit-identical fp32 logits for the same plans."""

from __future__ import annotations

import random

import pytest
import torch

from base.plan import KVLayout, NewSequence, Plan, SamplingParams
from tests.worker.worker_test_utils import GREEDY, VOCAB, PlanDriver, make_worker
from worker import PlanError

MAX_MODEL_LEN = 64
NUM_ROWS = 3


def contiguous_worker(path, block_size):
    """A contiguous worker with NUM_ROWS rows, sized by memory like the real flag."""
    probe = make_worker(path, block_size, max_model_len=MAX_MODEL_LEN, num_blocks=2)
    row_bytes = probe.kv_spec.bytes_per_token * MAX_MODEL_LEN
    return make_worker(
        path,
        block_size,
        kv_layout="contiguous",
        max_model_len=MAX_MODEL_LEN,
        num_blocks=None,
        kv_cache_memory=NUM_ROWS * row_bytes + row_bytes // 2,
    )


def run_scenario(worker) -> PlanDriver:
    """Three sequences at different stages, then one finishes and a fourth takes its row."""
    rng = random.Random(0)
    prompts = [[rng.randrange(VOCAB) for _ in range(n)] for n in (11, 18, 5, 9)]
    seeded = SamplingParams(temperature=0.9, top_p=0.9, seed=7)
    driver = PlanDriver(worker)
    driver.add(1, prompts[0])
    driver.add(2, prompts[1], sampling=seeded)
    driver.add(3, prompts[2])
    driver.step({1: None, 2: 7})
    driver.step({2: None, 1: None, 3: None})
    driver.decode([1, 2, 3], 4)
    driver.add(4, prompts[3])
    driver.step({4: None, 2: None, 3: None}, finished=[1])
    driver.decode([2, 3, 4], 6)
    return driver


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_identical_tokens_and_bit_exact_logits(checkpoint, block_size):
    _, path = checkpoint("qwen3-head-dim-tied")
    contiguous = contiguous_worker(path, block_size)
    paged = make_worker(
        path, block_size, max_model_len=MAX_MODEL_LEN, num_blocks=contiguous.describe().num_blocks
    )
    paged_run, contiguous_run = run_scenario(paged), run_scenario(contiguous)
    for seq_id in (1, 2, 3, 4):
        paged_seq, contiguous_seq = paged_run.seqs[seq_id], contiguous_run.seqs[seq_id]
        assert paged_seq.generated == contiguous_seq.generated
        assert len(paged_seq.logits) == len(contiguous_seq.logits) > 0
        for a, b in zip(paged_seq.logits, contiguous_seq.logits, strict=True):
            assert torch.equal(a, b)


def test_contiguous_reports_rows_and_equivalent_blocks(checkpoint):
    _, path = checkpoint("qwen3-head-dim-tied")
    info = contiguous_worker(path, block_size=4).describe()
    assert info.kv_layout == KVLayout.CONTIGUOUS
    assert info.max_concurrent_seqs == NUM_ROWS
    assert info.num_blocks == NUM_ROWS * MAX_MODEL_LEN // 4 + 1


def _new(seq_id, block_ids, start_pos=0):
    return NewSequence(seq_id, block_ids, [1, 2, 3], start_pos, GREEDY, True)


def test_contiguous_refuses_sharing_with_a_clear_hint(checkpoint):
    _, path = checkpoint("qwen3-head-dim-tied")
    worker = contiguous_worker(path, block_size=4)
    worker.execute(Plan(0, new=[_new(1, [1])]))
    with pytest.raises(PlanError, match="--no-prefix-caching"):
        worker.execute(Plan(1, new=[_new(2, [2, 3], start_pos=4)]))
    with pytest.raises(PlanError, match="--no-prefix-caching"):
        worker.execute(Plan(1, new=[_new(2, [2])], copies=[(1, 3)]))
    assert worker.num_sequences == 1


def test_contiguous_refuses_more_sequences_than_rows(checkpoint):
    _, path = checkpoint("qwen3-head-dim-tied")
    worker = contiguous_worker(path, block_size=4)
    too_many = [_new(i, [i]) for i in range(1, NUM_ROWS + 2)]
    with pytest.raises(PlanError, match="free rows"):
        worker.execute(Plan(0, new=too_many))
    worker.execute(Plan(1, new=too_many[:NUM_ROWS]))
    # A finished sequence's row is free again within the same plan.
    worker.execute(Plan(2, new=[too_many[NUM_ROWS]], finished=[1]))
    assert worker.num_sequences == NUM_ROWS
