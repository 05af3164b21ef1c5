"""Applying structured outputs' packed token masks to the logits they constrain.

The mask comes from llguidance as int32 words, bit t of a row = token t allowed (little-endian
bit order within each word). It is unpacked where it is cheapest: on the CPU by numpy's
`unpackbits` (one pass over bytes), on a GPU by shifts on the device, so only the packed
words (vocab / 8 bytes a row, 19 KB at 152k) cross the bus.

Order in the sampler: shaping (bias, penalties, min_tokens, ...) first, then the mask, so the
grammar has the last word: a row whose shaping and mask leave nothing (min_tokens banning the
EOS that the grammar requires, allowed_token_ids outside it) is drawn from the mask over the
raw logits instead. A row whose mask is empty (a matcher that refused a token: only the
discarded overlap extra after a sample ended) is left unconstrained.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor


def unpack_forbidden(bitmask: np.ndarray, vocab: int, device: torch.device) -> Tensor:
    """bool [rows, vocab]: True where the token is NOT allowed (what masked_fill_ takes; the
    words are inverted before unpacking, never the vocabulary-wide bools)."""
    inverted = np.ascontiguousarray(~bitmask)
    if device.type == "cpu":
        bits = np.unpackbits(inverted.view(np.uint8), axis=1, count=vocab, bitorder="little")
        return torch.from_numpy(bits).view(torch.bool)
    words = torch.from_numpy(inverted).to(device, non_blocking=True)
    shifts = torch.arange(32, dtype=torch.int32, device=device)
    bits = (words[:, :, None] >> shifts) & 1
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab].bool()


def apply_bitmask(
    logits: Tensor, raw: Tensor, rows: list[int], bitmask: np.ndarray, shaped: list[bool], keep_raw: bool
) -> Tensor:
    """`logits` with every token its row's mask forbids at -inf; `rows[j]` is the logit row of
    mask row j, `shaped[j]` whether shaping touched it. Masks in place where it can: `logits`
    when it is already a shaped copy, or `raw` itself when nothing needs the raw logits after
    this (`keep_raw` False: no row asks for logprobs). Each pass over [rows, vocab] costs
    milliseconds at 64 x 152k on a CPU, so there is one: unpack, fill."""
    if not rows:
        return logits
    live = bitmask.any(axis=1)
    if not live.all():
        rows = [r for r, keep in zip(rows, live, strict=True) if keep]
        shaped = [s for s, keep in zip(shaped, live, strict=True) if keep]
        bitmask = bitmask[live]
        if not rows:
            return logits
    forbidden = unpack_forbidden(bitmask, logits.shape[1], logits.device)
    out = logits.clone() if (logits is raw and keep_raw) else logits
    if rows == list(range(out.shape[0])):
        out.masked_fill_(forbidden, float("-inf"))
    else:
        index = torch.tensor(rows, dtype=torch.int64, device=out.device)
        out[index] = out.index_select(0, index).masked_fill_(forbidden, float("-inf"))
    for j in (j for j, s in enumerate(shaped) if s):  # only shaping can empty an allowed set
        r = rows[j]
        if not bool(torch.isfinite(out[r]).any()):  # shaping and grammar disagree: the grammar wins
            out[r] = raw[r].masked_fill(forbidden[j], float("-inf"))
    return out
