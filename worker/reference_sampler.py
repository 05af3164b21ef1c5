"""The sampling oracle: one row at a time, in float32, exactly as worker.sampler documents
the semantics. Tests compare the batched `Sampler` (what the worker runs, on any device)
against it token for token; it is never on the serving path.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from base.plan import SamplingParams
from worker.sampler import SampledTokens, SamplingRow, sample_uniforms


class ReferenceSampler:
    def __init__(self, seed: int) -> None:
        self._generator = torch.Generator(device="cpu").manual_seed(seed)

    def sample(self, logits: Tensor, rows: Sequence[SamplingRow]) -> list[SampledTokens]:
        if logits.shape[0] != len(rows):
            raise ValueError(f"got {logits.shape[0]} logit rows for {len(rows)} sampling rows")
        logits = logits.float().cpu()
        uniforms = sample_uniforms(rows, self._generator)
        results = []
        for i, row in enumerate(rows):
            if row.params.temperature > 0:
                ids, cdf = truncated_cdf(logits[i], row.params)
                token_ids = [_invert(ids, cdf, u) for u in uniforms[i]]
            else:
                token_ids = [int(logits[i].argmax())] * row.num_samples
            logprobs = None
            if row.params.logprobs:
                logprobs = torch.log_softmax(logits[i], dim=-1)[token_ids].tolist()
            results.append(SampledTokens(token_ids, logprobs))
        return results


def _invert(candidate_ids: Tensor, cdf: Tensor, uniform: float) -> int:
    index = int(torch.searchsorted(cdf, uniform * cdf[-1], right=True).clamp_(max=cdf.numel() - 1))
    return int(candidate_ids[index])


def truncated_cdf(logits: Tensor, params: SamplingParams) -> tuple[Tensor, Tensor]:
    """The tokens a sampled row may emit and their (unnormalized) cumulative mass, float32.

    Returns (candidate_ids, cdf), both [K]; candidate_ids is every token when neither top_k
    nor top_p truncates (no sort needed), else the kept tokens by descending probability.
    """
    scaled = logits.to(torch.float32) / params.temperature
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
