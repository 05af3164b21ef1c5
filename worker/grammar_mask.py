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


def unpack(bitmask: np.ndarray, vocab: int, device: torch.device) -> Tensor:
    """bool [rows, vocab]: True where the token is allowed."""
    if device.type == "cpu":
        bits = np.unpackbits(bitmask.view(np.uint8), axis=1, count=vocab, bitorder="little")
        return torch.from_numpy(bits).view(torch.bool)
    words = torch.from_numpy(bitmask).to(device, non_blocking=True)
    shifts = torch.arange(32, dtype=torch.int32, device=device)
    bits = (words[:, :, None] >> shifts) & 1
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab].bool()


def apply_bitmask(logits: Tensor, raw: Tensor, rows: list[int], bitmask: np.ndarray) -> Tensor:
    """`logits` with every token its row's mask forbids at -inf; `rows[j]` is the logit row of
    mask row j. Never modifies `raw` (logprobs are of the raw distribution)."""
    if not rows:
        return logits
    live = bitmask.any(axis=1)
    if not live.all():
        rows = [r for r, keep in zip(rows, live, strict=True) if keep]
        bitmask = bitmask[live]
        if not rows:
            return logits
    allowed = unpack(np.ascontiguousarray(bitmask), logits.shape[1], logits.device)
    out = logits.clone() if logits is raw else logits
    everything = rows == list(range(out.shape[0]))
    index = None if everything else torch.tensor(rows, dtype=torch.int64, device=out.device)
    current = out if everything else out.index_select(0, index)
    masked = current.masked_fill(~allowed, float("-inf"))
    empty = ~torch.isfinite(masked).any(dim=-1)
    if bool(empty.any()):  # shaping and grammar disagree: the grammar wins
        source = raw if everything else raw.index_select(0, index)
        masked = torch.where(empty[:, None], source.masked_fill(~allowed, float("-inf")), masked)
    if everything:
        return masked
    out[index] = masked
    return out
