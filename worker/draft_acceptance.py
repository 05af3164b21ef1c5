"""Draft-model proposals and their acceptance: the rejection-sampling rule with a real q.

A draft verify's row i (worker/step_work.py: the 1 + k rows of ContinuingSequence.num_draft_tokens)
has the target's distribution p_i; the draft drew proposal d_i from its own q_i at the same
position with the same settings (temperature, top-k/top-p/min-p, logit bias).

    greedy:  d_i = argmax q_i; accepted while the target's argmax equals it
             (worker/speculative_verify.accept_greedy): the tokens of plain decoding.
    sampled: accept d_i with probability min(1, p_i(d_i) / q_i(d_i)); at the first rejection
             draw the step's last token from normalize(max(0, p_i - q_i)) and stop; all k
             accepted: the last row's ordinary sample (a draw from p_k) follows them.

The output law is p whatever q is (Leviathan et al. 2023, Chen et al. 2023): P(out = x) =
q(x) min(1, p(x)/q(x)) + (1 - sum_y min(p(y), q(y))) * max(0, p(x) - q(x)) / sum_y max(0,
p(y) - q(y)) = min(p, q)(x) + max(0, p - q)(x) = p(x), since both sums equal 1 - sum min(p, q).

Uniforms: each draw has its own stream so none correlates with another. A seeded request's
are hashes of (seed ^ salt, sample index, position) (worker/sampler.token_uniform), so it gets
the same tokens run to run (the logits being equal); the bonus token uses the ordinary,
unsalted uniform. Unseeded requests draw from the draft's own generator.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from base.plan import SamplingParams
from worker.sampler import SampledTokens, SamplingRow, token_uniform

DRAFT_SALT = 0x5D1A_F7C3_0000_0001  # the draft's own draw of d_i
ACCEPT_SALT = 0x5D1A_F7C3_0000_0002  # the coin that accepts d_i
RESIDUAL_SALT = 0x5D1A_F7C3_0000_0003  # the draw from the residual after a rejection


def probabilities(shaped: Tensor, params: Sequence[SamplingParams]) -> Tensor:
    """[R, V] float64: the distribution the ordinary sampler (worker/sampler.py) draws from for
    each sampled row: logits / temperature, min_p, top-k, then top-p over the top-k-normalized
    mass (the first token always kept), renormalized. Dense: every row is sorted once."""
    temps = torch.tensor([p.temperature for p in params], dtype=torch.float64)
    x = shaped.double() / temps[:, None]
    min_p = torch.tensor([p.min_p for p in params], dtype=torch.float64)
    if bool((min_p > 0).any()):
        floor = x.max(dim=-1, keepdim=True).values + torch.log(min_p)[:, None]
        x = x.masked_fill(x < floor, float("-inf"))
    vocab = x.shape[1]
    for i, p in enumerate(params):
        if not (0 < p.top_k < vocab or p.top_p < 1.0):
            continue
        values, ids = torch.sort(x[i], descending=True, stable=True)
        k = p.top_k if 0 < p.top_k < vocab else vocab
        probs = torch.softmax(values[:k], dim=-1)
        keep = k
        if p.top_p < 1.0:
            before = torch.cumsum(probs, dim=-1) - probs
            keep = max(1, int((before < p.top_p).sum()))
        row = torch.full_like(x[i], float("-inf"))
        row[ids[:keep]] = values[:keep]
        x[i] = row
    return torch.softmax(x, dim=-1)


def draw(probs: Tensor, u: float) -> int:
    """Inverse CDF in vocabulary order (what the sampler does for an untruncated row)."""
    cdf = torch.cumsum(probs, dim=-1)
    pick = torch.searchsorted(cdf, torch.tensor([u * float(cdf[-1])], dtype=cdf.dtype), right=True)
    index = min(int(pick[0]), probs.shape[0] - 1)
    while probs[index] <= 0 and index > 0:  # a rounding step onto a zero-mass tail
        index -= 1
    return index


class Uniforms:
    """One uniform in [0, 1) per (row, purpose): seeded rows from their hash, others from
    the generator."""

    def __init__(self, seed: int) -> None:
        self.generator = torch.Generator(device="cpu").manual_seed(seed)

    def __call__(self, row: SamplingRow, salt: int) -> float:
        seed = row.params.seed
        if seed is not None:
            return token_uniform(seed ^ salt, row.sample_index, row.position)
        return float(torch.rand(1, generator=self.generator, dtype=torch.float64))


def accept_sampled(
    p: Tensor,
    q: Tensor,
    proposals: list[int],
    rows: Sequence[SamplingRow],
    bonus: int,
    uniform: Uniforms,
) -> list[int]:
    """The verify's tokens (a accepted proposals and the token after them) for one sampled
    sequence: p [k + 1, V] the target's distributions, q [k, V] the draft's, `bonus` the last
    row's ordinary sample."""
    out = []
    for i, d in enumerate(proposals):
        if uniform(rows[i], ACCEPT_SALT) * float(q[i, d]) < float(p[i, d]):
            out.append(d)
            continue
        residual = (p[i] - q[i]).clamp_(min=0.0)
        if float(residual.sum()) <= 0.0:  # p == q up to rounding: d was all but certain
            residual = p[i].clone()
            residual[d] = 0.0
        out.append(draw(residual, uniform(rows[i], RESIDUAL_SALT)))
        return out
    out.append(bonus)
    return out


def with_token(sample: SampledTokens, token: int, raw: Tensor) -> SampledTokens:
    """`sample` (one row's ordinary output) with its token replaced: the logprob becomes the
    new token's under the raw logits row `raw`; the alternatives are the row's, unchanged."""
    if sample.token_ids[0] == token:
        return sample
    logprobs = None
    if sample.logprobs is not None:
        logprobs = [float(torch.log_softmax(raw.float(), dim=-1)[token])]
    return SampledTokens([token], logprobs, sample.top_ids, sample.top_logprobs)
