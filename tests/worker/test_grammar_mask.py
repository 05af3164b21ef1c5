"""The packed grammar mask applied to logits (worker/grammar_mask.py): the right tokens are
forbidden, raw logits survive when logprobs need them, a row the shaping emptied falls back to
the grammar over the raw logits, and an empty mask leaves its row unconstrained."""

from __future__ import annotations

import numpy as np
import torch

from worker.grammar_mask import apply_bitmask

VOCAB = 70  # not a multiple of 32: the last word's padding bits must be ignored


def _pack(allowed: list[set[int]]) -> np.ndarray:
    mask = np.zeros((len(allowed), (VOCAB + 31) // 32), dtype=np.int32)
    for i, ids in enumerate(allowed):
        for t in ids:
            mask[i, t // 32] |= np.int32(np.uint32(1 << (t % 32)).view(np.int32))
    return mask


def test_masks_the_right_rows_and_tokens_and_keeps_raw_when_asked():
    raw = torch.randn(3, VOCAB)
    before = raw.clone()
    allowed = [{0, 31, 32, 69}, {5}]
    out = apply_bitmask(raw, raw, [0, 2], _pack(allowed), [False, False], keep_raw=True)
    assert torch.equal(raw, before), "raw logits changed while logprobs need them"
    for row, ids in ((0, allowed[0]), (2, allowed[1])):
        finite = set(torch.nonzero(torch.isfinite(out[row])).flatten().tolist())
        assert finite == ids
        assert torch.equal(out[row, sorted(ids)], raw[row, sorted(ids)])
    assert torch.equal(out[1], raw[1])
    in_place = apply_bitmask(raw, raw, [0, 1, 2], _pack([{1}, {2}, {3}]), [False] * 3, keep_raw=False)
    assert in_place is raw and torch.isfinite(raw).sum() == 3


def test_grammar_wins_over_shaping_and_empty_masks_leave_rows_free():
    raw = torch.randn(2, VOCAB)
    shaped = raw.clone()
    shaped[0, :] = float("-inf")
    shaped[0, 7] = 1.0  # shaping allows only 7, the grammar only 8 and 9
    out = apply_bitmask(shaped, raw, [0, 1], _pack([{8, 9}, set()]), [True, False], keep_raw=True)
    assert set(torch.nonzero(torch.isfinite(out[0])).flatten().tolist()) == {8, 9}
    assert torch.equal(out[0, [8, 9]], raw[0, [8, 9]])
    assert torch.equal(out[1], raw[1])  # an all-zero mask: a refused matcher, unconstrained
