"""One client's view of a live request: text decoding, stop strings, and the queue it reads.

The engine loop turns each step's `RequestOutput`s into `Chunk`s here and pushes them; the
gRPC handler awaits `next()`. Per sample:

    token ids ──IncrementalDetokenizer──▶ text ──stop-string matcher──▶ emitted text

Stop strings (engine-level, the worker never sees them): while a sample runs, the last
`max(len(stop)) - 1` characters are held back, so emitted text never contains the start of a
stop string that a later token completes. On a match the text is cut *before* the stop
string and the engine ends the sample (`Scheduler.finish_sample`). When a sample ends for any
other reason the held-back text is flushed into its last message. Invariant: concatenating a
sample's `Chunk.text`s gives its decoded output, cut at the first stop string.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field, replace

from base.tokenizer import IncrementalDetokenizer, Tokenizer
from control_plane.errors import EngineError
from control_plane.request import FinishReason, RequestOutput, Usage


@dataclass(slots=True)
class TokenTimings:
    """Latencies one `push` observed, for the metrics: the request's time to first token (at
    most once per request) and, per sample, the gap since that sample's previous token."""

    first_token_s: float | None = None
    inter_token_s: list[float] = field(default_factory=list)


@dataclass(slots=True)
class Chunk:
    """One GenerateResponse worth of output for one sample."""

    index: int
    token_ids: list[int]
    text: str
    finish_reason: FinishReason | None
    usage: Usage | None
    logprobs: list[float] | None
    cumulative_logprob: float | None = None  # beam search's final messages
    beam_score: float | None = None
    top_logprobs: list[tuple[list[int], list[float]]] | None = None  # per token
    prompt_logprobs: list | None = None  # control_plane.request.PromptTokenLogprob, positions 1..


def merge_steps(steps: list[list[Chunk]]) -> list[Chunk]:
    """Several steps' chunks as one chunk per sample, in order of each sample's first chunk:
    tokens, text, logprobs and top logprobs concatenated; the finish, usage and beam fields
    from the sample's last chunk (the only one that has them); prompt logprobs from its first
    (the only one that has them)."""
    merged: dict[int, Chunk] = {}
    for chunks in steps:
        for c in chunks:
            m = merged.get(c.index)
            if m is None:
                merged[c.index] = replace(c, token_ids=list(c.token_ids))
                continue
            m.token_ids += c.token_ids
            m.text += c.text
            m.logprobs = _concat(m.logprobs, c.logprobs)
            m.top_logprobs = _concat(m.top_logprobs, c.top_logprobs)
            m.finish_reason, m.usage = c.finish_reason, c.usage
            m.cumulative_logprob, m.beam_score = c.cumulative_logprob, c.beam_score
    return list(merged.values())


def _concat(a: list | None, b: list | None) -> list | None:
    return b if a is None else a if b is None else a + b


class _SampleText:
    __slots__ = ("_detok", "_pending", "_stops", "_hold", "_min_tokens", "_count")

    def __init__(self, tokenizer: Tokenizer, stops: tuple[str, ...], min_tokens: int = 0) -> None:
        self._detok = IncrementalDetokenizer(tokenizer)
        self._stops = stops
        self._hold = max((len(s) for s in stops), default=1) - 1
        self._pending = ""
        self._min_tokens, self._count = min_tokens, 0

    def feed(self, token_ids: list[int]) -> tuple[str, int | None]:
        """Returns (text to emit now, None or -- a stop string matched -- how many of
        `token_ids` it took to complete it: the rest are dropped, never streamed or counted).
        Several tokens at once (a speculative verify's accepted run) are matched one by one.
        Text of the first min_tokens tokens is never matched: a sample cannot stop before them."""
        if len(token_ids) > 1 and self._stops:
            text = ""
            for i, token in enumerate(token_ids):
                new, matched = self._feed_one([token])
                text += new
                if matched:
                    return text, i + 1
            return text, None
        text, matched = self._feed_one(token_ids)
        return text, len(token_ids) if matched else None

    def _feed_one(self, token_ids: list[int]) -> tuple[str, bool]:
        self._count += len(token_ids)
        new = self._detok.add(token_ids) if token_ids else ""
        if self._count <= self._min_tokens:
            return new, False
        return self._cut(new, final=False)

    def flush(self) -> tuple[str, bool]:
        """The rest of the text when the sample ends otherwise; a stop string may still match
        in it (e.g. one ending in a held-back U+FFFD)."""
        return self._cut(self._detok.flush(), final=True)

    def _cut(self, new: str, final: bool) -> tuple[str, bool]:
        if not self._stops:
            return new, False
        pending = self._pending + new
        cut = min((i for i in (pending.find(s) for s in self._stops) if i >= 0), default=-1)
        if cut >= 0:
            self._pending = ""
            return pending[:cut], True
        keep = 0 if final else min(self._hold, len(pending))
        self._pending = pending[len(pending) - keep :]
        return pending[: len(pending) - keep], False


class RequestStream:
    """Output queue of one request. Single consumer (the RPC handler), single producer (the loop)."""

    def __init__(
        self,
        request_id: str,
        n: int,
        tokenizer: Tokenizer | None,
        stops: tuple[str, ...] = (),
        arrival: int = 0,
        min_tokens: int = 0,
    ) -> None:
        if stops and tokenizer is None:
            raise ValueError("stop strings need a tokenizer")
        self.request_id = request_id
        self.arrival = arrival  # the request's admission serial: what outputs are matched by
        self.n = n
        self._texts = (
            [_SampleText(tokenizer, stops, min_tokens) for _ in range(n)] if tokenizer is not None else None
        )
        self._queue: asyncio.Queue[list[Chunk] | EngineError] = asyncio.Queue()
        self._error: EngineError | None = None  # taken from the queue behind chunks, not yet raised
        self._num_finished = 0
        self.done = False  # every sample has finished, or the stream failed
        self.created = time.monotonic()
        self.first_token_at: float | None = None
        self._last_token_at: list[float | None] = [None] * n  # per sample, for inter-token gaps
        self.num_tokens = 0

    def to_chunk(self, out: RequestOutput) -> tuple[Chunk, int | None]:
        """Decode one output. Returns (chunk, None or -- a stop string matched: the engine must
        end the sample -- how many of the output's tokens came after the stop: the chunk's
        token ids and logprobs are cut before them; the sample's usage must not count them)."""
        text, kept = "", None
        if self._texts is not None:
            sample = self._texts[out.index]
            text, kept = sample.feed(out.new_token_ids)
            if out.finish_reason is not None and kept is None:
                rest, matched = sample.flush()
                text += rest
                kept = len(out.new_token_ids) if matched else None
        n = len(out.new_token_ids) if kept is None else kept
        chunk = Chunk(
            out.index,
            out.new_token_ids[:n],
            text,
            out.finish_reason,
            out.usage,
            None if out.logprobs is None else out.logprobs[:n],
            out.cumulative_logprob,
            out.beam_score,
            None if out.top_logprobs is None else out.top_logprobs[:n],
            out.prompt_logprobs,
        )
        return chunk, None if kept is None else len(out.new_token_ids) - kept

    def push(self, chunks: list[Chunk]) -> TokenTimings:
        """Queue one step's chunks for the client; returns the latencies they complete.

        One inter-token gap per token-bearing chunk after a sample's first (a step gives a
        sample at most one token), so a sample of k tokens contributes k - 1 gaps."""
        timings = TokenTimings()
        if self.done:
            return timings
        now = time.monotonic()
        for c in chunks:
            if c.token_ids:
                self.num_tokens += len(c.token_ids)
                if self.first_token_at is None:
                    self.first_token_at = now
                    timings.first_token_s = now - self.created
                last = self._last_token_at[c.index]
                if last is not None:
                    timings.inter_token_s.append(now - last)
                self._last_token_at[c.index] = now
            if c.finish_reason is not None:
                self._num_finished += 1
        self.done = self._num_finished >= self.n
        self._queue.put_nowait(chunks)
        return timings

    def fail(self, error: EngineError) -> None:
        """End the stream with an error status (worker lost, server stopping)."""
        if not self.done:
            self.done = True
            self._queue.put_nowait(error)

    async def next(self) -> list[Chunk]:
        """The chunks pushed since the last call, one per sample (a reader that fell behind
        gets several steps' tokens in one message each: fewer messages to write, the same
        concatenated output); raises the failure if the stream failed (after the chunks
        pushed before it)."""
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        item = await self._queue.get()
        if isinstance(item, EngineError):
            raise item
        if self._queue.empty():  # the reader keeps up: the common case
            return item
        steps = [item]
        while not self._queue.empty():
            item = self._queue.get_nowait()
            if isinstance(item, EngineError):
                self._error = item
                break
            steps.append(item)
        return merge_steps(steps)

    def drained(self) -> bool:
        return self.done and self._queue.empty() and self._error is None
