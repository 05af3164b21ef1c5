"""Logit shaping before the draw, batched over the step's sampling rows on the logits' device:
logit_bias, allowed_token_ids, min_tokens, then the repetition / frequency / presence
penalties (base/sampling.py states the order and the semantics). Rows that shape nothing are
left alone, and a step where no row shapes returns the logits untouched (no copy).

The penalties touch only the tokens a sequence has seen (its TokenCounts.ids), gathered for
all penalized rows into flat (row, token) index tensors: one gather, the arithmetic, one
scatter, whatever the batch. min_p works on the temperature-scaled logits, so it lives with
the draw (worker/sampler.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor


def shape_logits(logits: Tensor, rows: Sequence, eos_token_ids: tuple[int, ...]) -> Tensor:
    """The logits the token is picked from; `rows[i]` (a worker.sampler.SamplingRow) shapes
    logits[i]. Never modifies `logits` (logprobs are of the raw distribution)."""
    shaping = [i for i, row in enumerate(rows) if row.params.shapes_logits]
    if not shaping:
        return logits
    out = logits.clone()
    device = logits.device
    biased = [(i, t, b) for i in shaping for t, b in rows[i].params.logit_bias]
    if biased:
        r, t, b = zip(*biased, strict=True)
        out.index_put_((_long(r, device), _long(t, device)), torch.tensor(b, device=device), accumulate=True)
    for i in shaping:
        allowed = rows[i].params.allowed_token_ids
        if allowed:
            keep = out[i, _long(allowed, device)]
            out[i].fill_(float("-inf"))
            out[i, _long(allowed, device)] = keep
    banned = [(i, t) for i in shaping for t in _stop_ids_to_ban(rows[i], eos_token_ids)]
    if banned:
        r, t = zip(*banned, strict=True)
        out[_long(r, device), _long(t, device)] = float("-inf")
    _penalize(out, [i for i in shaping if rows[i].params.has_penalties], rows)
    return out


def _stop_ids_to_ban(row, eos_token_ids: tuple[int, ...]) -> list[int]:
    """min_tokens: the stop tokens, while fewer than min_tokens tokens were generated."""
    params = row.params
    if not params.min_tokens or row.num_generated >= params.min_tokens:
        return []
    eos = () if params.ignore_eos else eos_token_ids
    return sorted(set(params.stop_token_ids) | set(eos))


def _penalize(out: Tensor, penalized: list[int], rows: Sequence) -> None:
    if not penalized:
        return
    device = out.device
    ids = [rows[i].counts.ids for i in penalized]
    lengths = [len(a) for a in ids]
    if not sum(lengths):
        return
    flat = np.concatenate(ids)
    counts = np.concatenate([rows[i].counts.count[a] for i, a in zip(penalized, ids, strict=True)])
    row_of = np.repeat(np.asarray(penalized, dtype=np.int64), lengths)
    per_row = lambda name: np.repeat([getattr(rows[i].params, name) for i in penalized], lengths)  # noqa: E731
    r, t = torch.from_numpy(row_of).to(device), torch.from_numpy(flat).to(device)
    c = torch.from_numpy(counts).to(device=device, dtype=out.dtype)
    rep = torch.from_numpy(per_row("repetition_penalty")).to(device=device, dtype=out.dtype)
    freq = torch.from_numpy(per_row("frequency_penalty")).to(device=device, dtype=out.dtype)
    pres = torch.from_numpy(per_row("presence_penalty")).to(device=device, dtype=out.dtype)
    values = out[r, t]
    # Hugging Face's RepetitionPenaltyLogitsProcessor: every token of prompt or output
    values = torch.where(values > 0, values / rep, values * rep)
    # OpenAI: output tokens only (a prompt-only token has count 0 and is untouched)
    values = values - freq * c - pres * (c > 0).to(out.dtype)
    out[r, t] = values


def _long(values, device) -> Tensor:
    return torch.tensor(list(values), dtype=torch.int64, device=device)
