"""A speculative verify on the worker: which proposals the step's own samples accept.

A verify sequence (base/plan.py ContinuingSequence.num_speculative_tokens = k) has 1 + k
sampling rows, one after each input [t, p1 .. pk], each sampled by the ordinary sampler (its
shaping, temperature, top-k/top-p/min-p, seeded uniform for its position). p_i is accepted
while sample i-1 equals it; the first disagreement ends the run and that row's sample is the
step's last token; all accepted, the last row's sample follows them. a + 1 tokens come back.

Greedy: the samples are argmaxes, so the tokens are exactly what a + 1 plain decode steps give.

Sampled: this *is* the rejection-sampling rule for a point-mass proposal (n-gram proposals have
q = 1 at p_i). With p the row's target distribution, the rule accepts p_i with probability
min(1, p(p_i) / q(p_i)) = p(p_i) and otherwise draws from the normalized residual
max(0, p - q), which is p without p_i, renormalized. Drawing x ~ p and accepting iff x == p_i
does both at once: P(accept) = p(p_i), and a rejected x is distributed as p conditioned on
x != p_i. So every output token is distributed exactly as without speculation. Because a
seeded row's uniform is a hash of (seed, sample index, position) (worker/sampler.py), a seeded
request even gets the very tokens it gets without speculation (the logits being equal).
A draft model's proposals (q not a point mass) would need the general rule; not built.
"""

from __future__ import annotations

from collections.abc import Iterator

from worker.sampler import SampledTokens, SamplingRow


def accept_greedy(proposals: list[int], samples: list[SampledTokens]) -> int:
    """How many leading proposals the samples agree with."""
    accepted = 0
    while accepted < len(proposals) and samples[accepted].token_ids[0] == proposals[accepted]:
        accepted += 1
    return accepted


def merge(samples: list[SampledTokens]) -> SampledTokens:
    """One output of the kept rows' tokens, logprobs and alternatives, in order."""
    first = samples[0]
    return SampledTokens(
        [s.token_ids[0] for s in samples],
        None if first.logprobs is None else [s.logprobs[0] for s in samples],
        None if first.top_ids is None else [t for s in samples for t in s.top_ids],
        None if first.top_logprobs is None else [t for s in samples for t in s.top_logprobs],
    )


def sequence_outputs(
    sampled_ids: list[int],
    rows: list[SamplingRow],
    samples: list[SampledTokens],
    proposals: dict[int, list[int]],
) -> Iterator[tuple[int, SampledTokens, SamplingRow, int | None]]:
    """Per sampling sequence: (seq id, its output, the row of its last token, and for a verify
    the positions that stay computed -- the last kept token's position -- else None)."""
    i, num = 0, len(rows)
    while i < num:
        seq_id = sampled_ids[i]
        if seq_id not in proposals:
            yield seq_id, samples[i], rows[i], None
            i += 1
            continue
        wanted = proposals[seq_id]
        end = i + len(wanted) + 1
        accepted = accept_greedy(wanted, samples[i:end])
        last = rows[i + accepted]
        yield seq_id, merge(samples[i : i + accepted + 1]), last, last.position
        i = end
