"""Speculative decoding, the control plane's half: n-gram (prompt lookup) proposals, which
decodes speculate, and the counters `pagedkv stats` shows. The rollback of rejected slots is
`SchedulerUpdate._apply_verified` + `KVCacheManager.truncate`.

One verify step of a sequence with N known tokens (t[N-1] not yet computed) and k proposals:

    plan:    inputs [t[N-1], p1 .. pk] at positions N-1 .. N-1+k  (allocate_slots(seq, 1 + k))
    worker:  a sample at every input (the ordinary sampler: greedy or the rejection-sampling
             rule, worker/speculative_verify.py); accepts p_i while sample i-1 == p_i;
             returns the a accepted proposals and the sample after them (a + 1 tokens)
    update:  appends them (a stop inside the run drops the rest), then rolls back:
             num_computed_tokens N+k -> N+a (position N+a holds a rejected input's K/V; the
             next step overwrites it), table cut to ceil((N+a) / block_size) blocks: a block
             only rejected positions reached goes back to the pool at once. The worker cuts
             its mirror by the same rule when it verifies, so both tables stay equal.

No block is ever hashed with a rejected token: hashing reads `token_ids`, which only ever hold
accepted tokens, and caching is capped at the known tokens (KVCacheManager.cache_full_blocks).

Overlap scheduling: a verify's outcome (how many positions survive) is unknown until its
result arrives, so a sequence with a verify in flight sits out the plans made meanwhile (as a
beam does). Alone, the plan in between is empty and never sent; so a speculating stream runs
the strict loop, trading one round trip per step for up to k extra tokens. A decode in flight
(no proposals) keeps overlapping: the next plan feeds its sample as usual unless a lookup on
the known tokens finds a match, in which case it sits out one plan to speculate with every
token known (`decide`).

Draft-model proposals (`--speculative draft`): the worker's draft model proposes, so the plan
asks for k draft tokens (ContinuingSequence.num_draft_tokens) after the one known input instead
of sending proposals; slots, rollback, overlap and back-off are the n-gram ones (worker side:
worker/draft_model.py). `decide` returns k DRAFT_SLOTs, or sits a plan out while a decode of the
sequence is in flight (the draft proposes from every known token).

Backing off: a verify that accepts nothing makes the sequence skip the lookup for 2, 4, .. 32
decodes (reset by any acceptance), so a stream whose output does not repeat its context pays
for a failed verify rarely; a lookup that finds nothing skips the next two, so a stream does
not alternate between sitting a plan out (a match on the known tokens) and finding nothing.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field

METHODS = ("", "ngram", "draft")  # "" = off
MAX_BACKOFF = 32
# A proposal slot the worker's draft model fills (`--speculative draft`): `decide` returns k of
# them and the plan asks for k draft tokens (ContinuingSequence.num_draft_tokens) instead of
# sending proposals. The control plane never learns the proposals, only the accepted tokens.
DRAFT_SLOT = -1


@dataclass(slots=True)
class SpeculativeConfig:
    method: str = ""  # "" (off) | "ngram" | "draft" (the worker's --draft-model proposes)
    num_speculative_tokens: int = 3  # k: proposals per verify step at most
    prompt_lookup_min: int = 2  # shortest suffix matched
    prompt_lookup_max: int = 4  # longest suffix matched (tried first)
    # Speculate only while at most this many sequences run: a large batch is compute-bound,
    # where verifying k rejected tokens costs k tokens of compute. Set from the single-stream
    # benchmark (bench/speculative.py); larger batches were not measured.
    max_batch_size: int = 4

    def validate(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative method must be one of {METHODS[1:]} or empty, got {self.method!r}")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError(f"num_speculative_tokens must be in [1, 16], got {self.num_speculative_tokens}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(
                f"need 1 <= prompt_lookup_min ({self.prompt_lookup_min}) <= prompt_lookup_max "
                f"({self.prompt_lookup_max})"
            )
        if self.max_batch_size < 1:
            raise ValueError(f"speculative max_batch_size must be >= 1, got {self.max_batch_size}")


def propose_ngram(tokens: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """k tokens that followed the most recent earlier occurrence of the longest suffix of
    `tokens` of length n_max .. n_min; [] if none occurs. A continuation that runs into the
    suffix itself goes on with the proposals (a loop of period d repeats: the most recent
    occurrence of a looping suffix is d tokens back, so cutting there would propose < k).
    Searched as bytes (C speed: a Python loop over a 2k-token context cost ~0.3 ms a step);
    a hit must be 4-byte aligned."""
    num = len(tokens)
    if k < 1 or num < n_min + 1:
        return []
    data = array("I", tokens).tobytes()
    limit = (num - 1) * 4  # an occurrence must leave >= 1 token after it before the suffix's end
    for n in range(min(n_max, num - 1), n_min - 1, -1):
        pattern = data[(num - n) * 4 :]
        pos = data.rfind(pattern, 0, limit)
        while pos > 0 and pos % 4:
            pos = data.rfind(pattern, 0, pos + len(pattern) - 1)
        if pos >= 0:
            return _continue(tokens, pos // 4 + n, k)
    return []


def _continue(tokens: list[int], start: int, k: int) -> list[int]:
    """tokens[start : start + k], continued periodically past the end (start < len(tokens))."""
    out = tokens[start : start + k]
    period = len(tokens) - start
    while len(out) < k:
        out.append(out[len(out) - period])
    return out


@dataclass(slots=True)
class SpeculationStats:
    """Counters since start. Position i counts verifies that proposed > i tokens (proposed)
    and those whose first i + 1 proposals were all accepted (accepted)."""

    num_verifies: int = 0
    num_proposed: int = 0
    num_accepted: int = 0
    proposed_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)

    def record(self, num_proposed: int, num_accepted: int) -> None:
        self.num_verifies += 1
        self.num_proposed += num_proposed
        self.num_accepted += num_accepted
        grow = num_proposed - len(self.proposed_per_position)
        if grow > 0:
            self.proposed_per_position.extend([0] * grow)
            self.accepted_per_position.extend([0] * grow)
        for i in range(num_proposed):
            self.proposed_per_position[i] += 1
        for i in range(num_accepted):
            self.accepted_per_position[i] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted / self.num_proposed if self.num_proposed else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Accepted proposals per verify step (the tokens a step yields is this + 1)."""
        return self.num_accepted / self.num_verifies if self.num_verifies else 0.0

    def acceptance_per_position(self) -> list[float]:
        return [
            a / p if p else 0.0
            for a, p in zip(self.accepted_per_position, self.proposed_per_position, strict=True)
        ]


class Speculator:
    """Which decodes speculate, with which proposals; one per scheduler."""

    def __init__(self, config: SpeculativeConfig) -> None:
        config.validate()
        self.config = config
        self.stats = SpeculationStats()

    def eligible(self, seq, num_running: int) -> bool:
        """Sequences without penalties, grammars or an opt-out, in small batches; greedy and
        sampled alike (worker/speculative_verify.py: the acceptance rule for each)."""
        req = seq.request
        s = req.sampling
        return (
            num_running <= self.config.max_batch_size
            and seq.synced
            and not s.disable_speculation
            and not s.has_penalties
            and s.structured is None
            and req.beam is None
            and (s.n == 1 or req.forked)
        )

    def decide(self, seq, num_running: int, max_new: int, max_model_len: int) -> list[int] | None:
        """The proposals for `seq`'s next decode ([] = a plain decode), or None: sit this plan out.
        `max_new`: tokens the step's budget leaves for proposals."""
        if not self.eligible(seq, num_running):
            return []
        if seq.spec_backoff_left > 0:
            seq.spec_backoff_left -= 1
            return []
        cfg = self.config
        left_by_length = min(
            seq.request.sampling.max_tokens - seq.num_output_tokens, max_model_len - seq.num_tokens
        )
        # The step yields up to k + 1 tokens; with a pending one, one fewer is left.
        k = min(cfg.num_speculative_tokens, max_new, left_by_length - 1 - seq.num_pending)
        if k < 1:
            return []
        if cfg.method == "draft":
            # The draft proposes from every known token: with a decode in flight, wait for it.
            return None if seq.num_pending else [DRAFT_SLOT] * k
        proposals = propose_ngram(seq.token_ids, k, cfg.prompt_lookup_min, cfg.prompt_lookup_max)
        if seq.num_pending:
            # A decode is in flight: a match on the known tokens says waiting for its token
            # (then verifying with it known) is likely to pay; no match, keep overlapping.
            return None if proposals else []
        if not proposals:
            seq.spec_backoff_left = 2  # don't sit out for the next lookups straight away
        return proposals

    def record(self, seq, num_proposed: int, num_accepted: int) -> None:
        self.stats.record(num_proposed, num_accepted)
        if num_accepted:
            seq.spec_misses = 0
        else:
            self._miss(seq)

    @staticmethod
    def _miss(seq) -> None:
        seq.spec_misses = min(seq.spec_misses + 1, MAX_BACKOFF.bit_length() - 1)
        seq.spec_backoff_left = 1 << seq.spec_misses
