"""Every malformed plan is rejected whole with a PlanError, and leaves the worker exactly as it
was: a following valid plan gives the same tokens, bit-identical logits and the same mirrored
tables as on a worker that never saw the bad plan."""

from __future__ import annotations

import pytest
import torch

from base.plan import ContinuingSequence, NewSequence, Plan, SamplingParams
from tests.worker.worker_test_utils import GREEDY, VOCAB, make_worker
from worker import PlanError

NUM_BLOCKS = 64
MAX_MODEL_LEN = 64  # 16 blocks of 4


def new(seq_id, block_ids, token_ids, start_pos=0, **fields):
    sampling = fields.pop("sampling", GREEDY)
    return NewSequence(seq_id, block_ids, token_ids, start_pos, sampling, True, **fields)


def cont(seq_id, token_ids, start_pos, new_block_ids=(), replaced=()):
    return ContinuingSequence(seq_id, list(new_block_ids), list(replaced), token_ids, start_pos, True)


def fresh_worker_with_history(path):
    """Seq 1: table [1, 2, 3], 10 tokens computed. Seq 2: table [4, 5], 6 computed."""
    worker = make_worker(path, block_size=4, num_blocks=NUM_BLOCKS, max_model_len=MAX_MODEL_LEN)
    first = worker.execute(Plan(0, new=[new(1, [1, 2, 3], list(range(10, 20)))]))
    second = worker.execute(Plan(1, new=[new(2, [4, 5], list(range(30, 36)))]))
    return worker, first.outputs[0].token_ids[0], second.outputs[0].token_ids[0]


def follow_up(t1, t2):
    return Plan(50, new=[new(3, [6], [7, 8, 9])], continuing=[cont(1, [t1], 10), cont(2, [t2], 6)])


def snapshot(worker):
    return {m.seq_id: (tuple(m.block_ids), m.num_computed_tokens) for m in worker.mirrors}


def bad_plans(t1, t2):
    """name -> (plan, fragment of the expected message)."""
    ok1 = cont(1, [t1], 10)
    return {
        "unknown continuing id": (Plan(9, continuing=[cont(99, [5], 0)]), "no such sequence"),
        "unknown finished id": (Plan(9, continuing=[ok1], finished=[99]), "no such sequence"),
        "continuing twice": (Plan(9, continuing=[ok1, cont(1, [t1], 10)]), "more than once"),
        "finished twice": (Plan(9, finished=[2, 2]), "twice"),
        "new id already live": (Plan(9, new=[new(1, [7], [5])], finished=[2]), "already has it"),
        "finished and continuing": (Plan(9, continuing=[ok1], finished=[1]), "both finished and continuing"),
        "block id out of range": (Plan(9, new=[new(3, [NUM_BLOCKS], [5])], finished=[2]), "outside the pool"),
        "null block in new table": (Plan(9, new=[new(3, [0], [5])], finished=[2]), "null block"),
        "null block appended": (Plan(9, continuing=[cont(1, [t1], 10, new_block_ids=[0])]), "null block"),
        "null block replacing": (Plan(9, continuing=[cont(1, [t1], 10, replaced=[(0, 0)])]), "null block"),
        "beyond table capacity": (Plan(9, continuing=[cont(1, [t1, 1, 2], 10)], finished=[2]), "cannot hold"),
        "token id >= vocab": (
            Plan(9, continuing=[cont(1, [VOCAB], 10)], finished=[2]),
            "outside the vocabulary",
        ),
        "negative token id": (Plan(9, continuing=[cont(1, [-1], 10)]), "outside the vocabulary"),
        "beyond max_model_len": (
            Plan(9, new=[new(3, list(range(6, 23)), [1] * (MAX_MODEL_LEN + 1))]),
            "exceed max_model_len",
        ),
        "table longer than max_model_len": (Plan(9, new=[new(3, list(range(6, 23)), [1])]), "exceeds the 16"),
        "copy out of range": (Plan(9, continuing=[ok1], copies=[(1, NUM_BLOCKS)]), "outside the pool"),
        "copy from the null block": (Plan(9, continuing=[ok1], copies=[(0, 7)]), "outside the pool"),
        "continuing num_samples 0": (
            Plan(9, continuing=[ContinuingSequence(1, [], [], [t1], 10, True, num_samples=0)]),
            "num_samples must be >= 1",
        ),
        "copy onto itself": (Plan(9, continuing=[ok1], copies=[(3, 3)]), "onto itself"),
        "copy destination twice": (Plan(9, copies=[(1, 7), (2, 7)]), "more than once"),
        # The copy itself is valid and would clobber live block 1: it must not happen.
        "replaced index out of range": (
            Plan(9, continuing=[cont(1, [t1], 10, replaced=[(3, 9)])], copies=[(2, 1)]),
            "replaced index 3 is outside",
        ),
        "replaced index twice": (
            Plan(9, continuing=[cont(1, [t1], 10, replaced=[(0, 9), (0, 10)])]),
            "twice",
        ),
        "empty token list": (Plan(9, continuing=[cont(1, [], 10)], finished=[2]), "no tokens"),
        "num_samples 0": (Plan(9, new=[new(3, [6], [1], num_samples=0)]), "num_samples"),
        "negative sample_index": (Plan(9, new=[new(3, [6], [1], sample_index=-1)]), "sample_index"),
        "invalid sampling": (
            Plan(9, new=[new(3, [6], [1], sampling=SamplingParams(temperature=-1.0))]),
            "invalid sampling",
        ),
        "negative start_pos": (Plan(9, new=[new(3, [6], [1], start_pos=-1)]), "start_pos"),
        "gap before start_pos": (Plan(9, continuing=[cont(1, [t1], 11)]), "skips positions"),
        "duplicate block in table": (Plan(9, new=[new(3, [6, 6], [1] * 5)]), "twice"),
        "write into a shared block": (Plan(9, new=[new(3, [1, 2, 3], [5], start_pos=10)]), "copy-on-write"),
        "two sequences write one block": (
            Plan(9, new=[new(3, [6], [1]), new(4, [6], [1])]),
            "copy-on-write",
        ),
        "fed sample plus token ids": (Plan(9, continuing=[fed(1, 10, token_ids=[t1])]), "one or the other"),
        "fed sample at the wrong position": (Plan(9, continuing=[fed(1, 9)]), "belongs at position 10"),
    }


def fed(seq_id, start_pos, token_ids=()):
    """Overlap scheduling: compute the token this worker sampled for `seq_id` last step."""
    return ContinuingSequence(seq_id, [], [], list(token_ids), start_pos, True, feed_last_sample=True)


@pytest.fixture(scope="module")
def reference(checkpoint):
    _, path = checkpoint("qwen3-head-dim-tied")
    worker, t1, t2 = fresh_worker_with_history(path)
    result, logits = worker.execute_with_logits(follow_up(t1, t2))
    return result, logits, snapshot(worker)


@pytest.mark.parametrize("case", list(bad_plans(0, 0)))
def test_malformed_plan_is_rejected_and_changes_nothing(checkpoint, reference, case):
    _, path = checkpoint("qwen3-head-dim-tied")
    worker, t1, t2 = fresh_worker_with_history(path)
    before = snapshot(worker)
    plan, message = bad_plans(t1, t2)[case]
    with pytest.raises(PlanError, match=message):
        worker.execute(plan)
    assert snapshot(worker) == before
    result, logits = worker.execute_with_logits(follow_up(t1, t2))
    expected_result, expected_logits, expected_state = reference
    assert result.outputs == expected_result.outputs
    assert torch.equal(logits, expected_logits)
    assert snapshot(worker) == expected_state


def test_error_names_the_step_and_sequence(checkpoint):
    _, path = checkpoint("qwen3-head-dim-tied")
    worker, t1, _ = fresh_worker_with_history(path)
    with pytest.raises(PlanError, match=r"^plan 9, sequence 1: .*cannot hold positions up to 12"):
        worker.execute(Plan(9, continuing=[cont(1, [t1, 1, 2], 10)]))


def test_valid_edge_cases_are_accepted(checkpoint):
    """Things that look odd but are legal: a finished id re-registered in the same plan
    (dropped first), a rewrite of the last computed position, an empty plan."""
    _, path = checkpoint("qwen3-head-dim-tied")
    worker, t1, _ = fresh_worker_with_history(path)
    assert worker.execute(Plan(9)).outputs == []
    worker.execute(Plan(10, new=[new(2, [7, 8], [1, 2, 3])], finished=[2]))
    assert worker.block_table(2) == (7, 8)
    worker.execute(Plan(11, continuing=[cont(1, [19, t1], 9)]))
    assert worker.mirrors[1].num_computed_tokens == 11


def test_a_fed_sample_computes_exactly_what_sending_it_would(checkpoint):
    """feed_last_sample is the worker's own last sample as input: same tokens, bit-identical
    logits and mirrors as a plan that sends that token; it is consumed by the step."""
    _, path = checkpoint("qwen3-head-dim-tied")
    sent, t1, t2 = fresh_worker_with_history(path)
    fed_worker, _, _ = fresh_worker_with_history(path)
    expected, expected_logits = sent.execute_with_logits(
        Plan(9, continuing=[cont(1, [t1], 10), cont(2, [t2], 6)])
    )
    got, logits = fed_worker.execute_with_logits(Plan(9, continuing=[fed(1, 10), fed(2, 6)]))
    assert got.outputs == expected.outputs and torch.equal(logits, expected_logits)
    assert snapshot(fed_worker) == snapshot(sent)
    # Seq 2 steps without sampling (a chunk); then there is no sample to feed.
    chunk = ContinuingSequence(2, [], [], [got.outputs[1].token_ids[0]], 7, False)
    fed_worker.execute(Plan(10, continuing=[chunk]))
    before = snapshot(fed_worker)
    with pytest.raises(PlanError, match="did not sample it"):
        fed_worker.execute(Plan(11, continuing=[fed(2, 8)]))
    assert snapshot(fed_worker) == before
    fed_worker.execute(Plan(12, continuing=[fed(1, 11)]))  # seq 1's sample from plan 9 is still there
