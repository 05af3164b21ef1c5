"""Turning each sampling sequence's last-position logits into tokens.

Per row (one sequence that samples this step), in this order:
  - temperature 0: greedy, argmax of the raw logits (lowest id on ties);
  - otherwise: logits / temperature, keep the top_k largest (0 = all), keep the smallest
    prefix of the remaining tokens, by descending probability, whose mass reaches top_p,
    renormalize, draw by inverse CDF with one uniform number in [0, 1).
`logprob` is always log_softmax of the RAW logits at the sampled token: the model's own
probability, independent of temperature and truncation (what clients compare across
settings).

Reproducibility. A seeded request's uniform for the token at position p of sample i is
drawn from a fresh generator seeded by a 64-bit mix of (seed, i, p): stateless, so the
same seed gives the same tokens whatever else is in the batch, in whichever order, and
after a preemption recomputes the sequence. (The logits themselves must match, which they
do up to floating-point effects of batch shape.) Unseeded requests draw from the worker's
own generator. A fan-out of n samples from one row uses sample indices
sample_index .. sample_index + n - 1, so child i continues with the stream it started.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from control_plane.plan import SamplingParams

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def token_seed(seed: int, sample_index: int, position: int) -> int:
    """Stable 63-bit seed for one drawn token (a positive torch seed on every platform)."""
    mixed = _splitmix64(_splitmix64(_splitmix64(seed & _MASK64) ^ sample_index) ^ position)
    return mixed >> 1


@dataclass(frozen=True, slots=True)
class SamplingRow:
    """What the sampler needs to know about one sampling sequence."""

    params: SamplingParams
    sample_index: int
    position: int  # position of the token being sampled = start_pos + len(token_ids)
    num_samples: int = 1


@dataclass(frozen=True, slots=True)
class SampledTokens:
    token_ids: list[int]
    logprobs: list[float] | None


class Sampler:
    def __init__(self, seed: int) -> None:
        self._generator = torch.Generator(device="cpu").manual_seed(seed)

    def sample(self, logits: Tensor, rows: Sequence[SamplingRow]) -> list[SampledTokens]:
        """logits: fp32 [len(rows), vocab], on any device. Returns one entry per row."""
        if logits.shape[0] != len(rows):
            raise ValueError(f"got {logits.shape[0]} logit rows for {len(rows)} sampling rows")
        if not rows:
            return []
        greedy_ids = logits.argmax(dim=-1).tolist()
        wants_logprobs = any(row.params.logprobs for row in rows)
        log_probs = torch.log_softmax(logits, dim=-1) if wants_logprobs else None
        host_logits = logits.cpu() if any(row.params.temperature > 0 for row in rows) else None
        results = []
        for i, row in enumerate(rows):
            if row.params.temperature > 0:
                token_ids = self._sample_row(host_logits[i], row)
            else:
                token_ids = [greedy_ids[i]] * row.num_samples
            logprobs = None
            if row.params.logprobs:
                logprobs = log_probs[i, torch.tensor(token_ids, device=logits.device)].tolist()
            results.append(SampledTokens(token_ids, logprobs))
        return results

    def _sample_row(self, logits: Tensor, row: SamplingRow) -> list[int]:
        candidate_ids, cdf = truncated_cdf(logits, row.params)
        tokens = []
        for k in range(row.num_samples):
            uniform = torch.rand((), generator=self._generator_for(row, k), dtype=torch.float64)
            index = int(torch.searchsorted(cdf, uniform * cdf[-1], right=True).clamp_(max=cdf.numel() - 1))
            tokens.append(int(candidate_ids[index]))
        return tokens

    def _generator_for(self, row: SamplingRow, k: int) -> torch.Generator:
        if row.params.seed is None:
            return self._generator
        seed = token_seed(row.params.seed, row.sample_index + k, row.position)
        return torch.Generator(device="cpu").manual_seed(seed)


def truncated_cdf(logits: Tensor, params: SamplingParams) -> tuple[Tensor, Tensor]:
    """The tokens a sampled row may emit and their (unnormalized) fp64 cumulative mass.

    Returns (candidate_ids, cdf), both [K]; candidate_ids is every token when neither top_k
    nor top_p truncates (no sort needed), else the kept tokens by descending probability.
    """
    scaled = logits.to(torch.float64) / params.temperature
    vocab = scaled.numel()
    top_k = params.top_k if 0 < params.top_k < vocab else 0
    if top_k == 0 and params.top_p >= 1.0:
        return torch.arange(vocab), torch.cumsum(torch.softmax(scaled, dim=-1), dim=-1)
    if top_k:
        kept, candidate_ids = torch.topk(scaled, top_k, sorted=True)
    else:
        kept, candidate_ids = torch.sort(scaled, descending=True, stable=True)
    probs = torch.softmax(kept, dim=-1)
    cdf = torch.cumsum(probs, dim=-1)
    if params.top_p < 1.0:
        # Keep token j while the mass strictly before it is below top_p: the first is always kept.
        num_kept = int(((cdf - probs) < params.top_p).sum())
        candidate_ids, cdf = candidate_ids[:num_kept], cdf[:num_kept]
    return candidate_ids, cdf
