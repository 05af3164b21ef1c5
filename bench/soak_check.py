"""The soak's checks: each response stream against the API contract (engine.proto), each
GetStats snapshot against the pool's invariants, and the tallies the report prints.

A violation is a string naming the request and what broke; the soak fails on any. The
checks are exact (counts and equalities), never about speed, so a slow machine changes how
much the soak does, not whether it passes.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

from base.v1 import engine_pb2
from bench.common import percentile
from bench.soak_workload import Spec

FINISH = engine_pb2.FinishReason
# Status codes a request of each kind may end with besides OK. INTERNAL and UNKNOWN are never
# allowed: they are server bugs.
ALLOWED_CODES = {
    "deadline": {"DEADLINE_EXCEEDED"},
    "hostile": {"INVALID_ARGUMENT", "RESOURCE_EXHAUSTED"},
}


@dataclass(slots=True)
class _Sample:
    tokens: list[int] = field(default_factory=list)
    finish: str = ""
    last_token_at: float | None = None


class StreamCheck:
    """Feeds one Generate stream's messages through the contract checks, and records the
    latencies (TTFT: send -> first token of any sample; ITL: gap between a sample's token
    messages divided by the tokens in the later one)."""

    def __init__(self, spec: Spec, vocab_size: int, eos_token_ids: tuple[int, ...], label: str) -> None:
        self.spec = spec
        self.vocab_size = vocab_size
        self.label = label
        self.stops = spec.stop_set() | (set() if spec.ignore_eos else set(eos_token_ids))
        self.samples = [_Sample() for _ in range(spec.n)]
        self.violations: list[str] = []
        self.request_id: str | None = spec.request_id or None
        self.sent = time.perf_counter()
        self.ttft: float | None = None
        self.itl: list[float] = []
        self.num_beam_messages = 0
        self.last_beam_score: float | None = None

    def _bad(self, what: str) -> None:
        self.violations.append(f"{self.label}: {what}")

    def feed(self, m: engine_pb2.GenerateResponse) -> None:
        now = time.perf_counter()
        if self.request_id is None:
            self.request_id = m.request_id
        if m.request_id != self.request_id:
            self._bad(f"message for request id {m.request_id[:40]!r}")
        if not 0 <= m.index < self.spec.n:
            return self._bad(f"sample index {m.index} outside [0, {self.spec.n})")
        s = self.samples[m.index]
        if s.finish:
            return self._bad(f"sample {m.index}: message after its finish ({s.finish}): {list(m.token_ids)}")
        if any(t >= self.vocab_size for t in m.token_ids):
            self._bad(f"sample {m.index}: token outside the vocabulary: {list(m.token_ids)}")
        if len(m.logprobs) != (len(m.token_ids) if self.spec.logprobs else 0):
            self._bad(f"sample {m.index}: {len(m.logprobs)} logprobs for {len(m.token_ids)} tokens")
        if m.token_ids:
            self._time(s, now, len(m.token_ids))
        s.tokens.extend(m.token_ids)
        if self.spec.beam_width:
            self._check_beam_message(m)
        if m.finish_reason:
            s.finish = FINISH.Name(m.finish_reason).removeprefix("FINISH_REASON_")
            self._check_usage(m, s)
        elif m.HasField("usage"):
            self._bad(f"sample {m.index}: usage on a message that does not finish it")

    def _check_beam_message(self, m: engine_pb2.GenerateResponse) -> None:
        """Beam search: only final messages, in index order, best first, scored."""
        if not m.finish_reason:
            return self._bad(f"beam {m.index}: a message that does not finish it")
        if m.index != self.num_beam_messages:
            self._bad(f"beam {m.index}: came after {self.num_beam_messages} others (index order)")
        self.num_beam_messages += 1
        if m.finish_reason == FINISH.FINISH_REASON_ABORT:
            return
        if not m.HasField("beam_score") or not m.HasField("cumulative_logprob"):
            return self._bad(f"beam {m.index}: finished without beam_score / cumulative_logprob")
        if self.last_beam_score is not None and m.beam_score > self.last_beam_score:
            self._bad(
                f"beam {m.index}: score {m.beam_score} above the previous beam's {self.last_beam_score}"
            )
        self.last_beam_score = m.beam_score
        if m.logprobs and abs(sum(m.logprobs) - m.cumulative_logprob) > 1e-3 * max(1.0, len(m.logprobs)):
            self._bad(f"beam {m.index}: logprobs sum {sum(m.logprobs)} != cumulative {m.cumulative_logprob}")

    def _time(self, s: _Sample, now: float, count: int) -> None:
        if self.ttft is None:
            self.ttft = now - self.sent
        if s.last_token_at is not None:
            self.itl.extend([(now - s.last_token_at) / count] * count)
        s.last_token_at = now

    def _check_usage(self, m: engine_pb2.GenerateResponse, s: _Sample) -> None:
        if not m.HasField("usage"):
            return self._bad(f"sample {m.index}: finished ({s.finish}) without usage")
        u = m.usage
        if u.completion_tokens != len(s.tokens):
            self._bad(f"sample {m.index}: usage says {u.completion_tokens} tokens, received {len(s.tokens)}")
        if not self.spec.text and u.prompt_tokens != len(self.spec.prompt):
            self._bad(f"sample {m.index}: usage.prompt_tokens {u.prompt_tokens} != {len(self.spec.prompt)}")
        if u.cached_prompt_tokens > u.prompt_tokens:
            self._bad(f"sample {m.index}: cached {u.cached_prompt_tokens} > prompt {u.prompt_tokens} tokens")

    def finish(self, ok: bool, aborted_by_peer: bool) -> None:
        """The stream ended (OK, an error status or our cancel): every finished sample must
        have finished for a valid reason; on OK every sample must have finished."""
        for i, s in enumerate(self.samples):
            if s.finish:
                self.check_sample(i, s, aborted_by_peer)
            elif ok:
                self._bad(f"sample {i}: stream ended OK without a finish_reason")

    def check_sample(self, i: int, s: _Sample, aborted_by_peer: bool) -> None:
        spec = self.spec
        if len(s.tokens) > spec.max_tokens:
            self._bad(f"sample {i}: {len(s.tokens)} tokens > max_tokens {spec.max_tokens}")
        early = [t for t in s.tokens[:-1] if t in self.stops]
        if early:
            self._bad(f"sample {i}: stop token {early[0]} did not end the sample: {s.tokens}")
        if s.finish == "LENGTH" and len(s.tokens) != spec.max_tokens:
            self._bad(f"sample {i}: LENGTH after {len(s.tokens)} of {spec.max_tokens} tokens")
        if s.finish == "STOP" and (not s.tokens or s.tokens[-1] not in self.stops):
            self._bad(f"sample {i}: STOP but the last token is not a stop id: {s.tokens[-3:]}")
        if s.finish == "ABORT" and not aborted_by_peer:
            self._bad(f"sample {i}: ABORT although nobody aborted this request")
        if s.finish == "ERROR":
            self._bad(f"sample {i}: FINISH_REASON_ERROR on a stream that ended OK")

    def first_token_stops(self) -> int:
        """Samples of an n > 1 request that stopped on their first token (the fan-out case)."""
        if self.spec.n < 2:
            return 0
        return sum(1 for s in self.samples if s.finish == "STOP" and len(s.tokens) == 1)

    def tokens(self) -> list[list[int]]:
        return [s.tokens for s in self.samples]


def code_violation(spec: Spec, code: str, label: str, deadline_given: bool) -> str | None:
    """A non-OK status this request must not get; None when it is allowed."""
    kind = "hostile" if spec.kind.startswith("hostile") else spec.kind
    if code in ALLOWED_CODES.get(kind, ()) or (code == "DEADLINE_EXCEEDED" and deadline_given):
        return None
    if code == "DEADLINE_EXCEEDED":
        return f"{label}: no answer within the hang guard (DEADLINE_EXCEEDED): stalled or hung"
    return f"{label}: ended with status {code}"


def stats_violations(s: engine_pb2.EngineStats, max_num_seqs: int) -> list[str]:
    """Invariants every GetStats snapshot must satisfy, busy or idle."""
    out = []
    if s.num_blocks_free > s.num_blocks_total:
        out.append(f"GetStats: {s.num_blocks_free} free blocks > {s.num_blocks_total} total")
    if not 0.0 <= s.kv_usage <= 1.0:
        out.append(f"GetStats: kv_usage {s.kv_usage} outside [0, 1]")
    if s.num_running > max_num_seqs:
        out.append(f"GetStats: {s.num_running} sequences running > max_num_seqs {max_num_seqs}")
    if s.prefix_cache_hits > s.prefix_cache_queries:
        out.append(f"GetStats: {s.prefix_cache_hits} prefix hits > {s.prefix_cache_queries} queries")
    return out


def idle_violations(s: engine_pb2.EngineStats, info: engine_pb2.ModelInfo) -> list[str]:
    """After every request ended: nothing live, every block free. `num_blocks_total`
    already excludes the null block 0, so free == total == ModelInfo.facts.num_blocks - 1."""
    out = []
    if (s.num_running, s.num_waiting, s.num_live_requests) != (0, 0, 0):
        out.append(
            f"not idle after the drain: running={s.num_running} waiting={s.num_waiting} "
            f"live={s.num_live_requests}"
        )
    if s.num_blocks_total != info.facts.num_blocks - 1:
        out.append(
            f"num_blocks_total {s.num_blocks_total} != "
            f"ModelInfo.facts.num_blocks - 1 = {info.facts.num_blocks - 1}"
        )
    if s.num_blocks_free != s.num_blocks_total:
        out.append(f"block leak: {s.num_blocks_total - s.num_blocks_free} blocks still held when idle")
    held = {rc: n for rc, n in s.ref_count_histogram.items() if n}
    if held:
        out.append(f"blocks still referenced when idle (ref count: blocks): {held}")
    return out


@dataclass
class Tally:
    """Everything the report prints."""

    codes: Counter = field(default_factory=Counter)  # per request: "OK", "CANCELLED (client)", ...
    kinds: Counter = field(default_factory=Counter)
    finishes: Counter = field(default_factory=Counter)  # per sample
    aborts: Counter = field(default_factory=Counter)  # Abort RPC outcomes
    tokens: int = 0
    first_token_stops: int = 0
    beam_searches: int = 0  # beam requests that returned their beams
    stats_polls: int = 0
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    latency: list[float] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)

    @property
    def requests(self) -> int:
        return sum(self.codes.values())

    def add(self, check: StreamCheck, code: str) -> None:
        self.codes[code] += 1
        self.kinds[check.spec.kind] += 1
        for s in check.samples:
            self.tokens += len(s.tokens)
            self.finishes[s.finish or "(none)"] += 1
        self.first_token_stops += check.first_token_stops()
        self.beam_searches += bool(check.spec.beam_width and code == "OK")
        if check.ttft is not None:
            self.ttft.append(check.ttft)
        self.itl.extend(check.itl)
        if code == "OK":
            self.latency.append(time.perf_counter() - check.sent)
        self.violations.extend(check.violations)

    def summary(self, wall_s: float) -> str:
        lines = [
            f"requests {self.requests} in {wall_s:.1f} s; "
            f"tokens {self.tokens} ({self.tokens / max(wall_s, 1e-9):.1f} tok/s)",
            f"status codes: {dict(sorted(self.codes.items()))}",
            f"request kinds: {dict(sorted(self.kinds.items()))}",
            f"finish reasons (per sample): {dict(sorted(self.finishes.items()))}",
            f"n > 1 samples that stopped on their first token: {self.first_token_stops}; "
            f"beam searches completed: {self.beam_searches}",
            f"Abort RPCs: {dict(sorted(self.aborts.items()))}; GetStats polls: {self.stats_polls}",
        ]
        for name, values in (("TTFT", self.ttft), ("ITL", self.itl), ("request latency", self.latency)):
            if values:
                p = [percentile(values, q) * 1e3 for q in (50, 90, 99)]
                lines.append(f"{name} ms: p50 {p[0]:.1f}  p90 {p[1]:.1f}  p99 {p[2]:.1f}  (n={len(values)})")
        return "\n".join(lines)
