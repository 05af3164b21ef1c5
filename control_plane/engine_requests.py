"""The client-facing half of `AsyncEngine`: admitting requests, ending them, and handing
each step's outputs to their streams (text, stop strings, finish). A mixin, as
`SchedulerUpdate` is for `Scheduler`: same object, same single event-loop thread.

Size limits (control_plane.limits) are checked before any work that grows with a field;
long texts are tokenized (and long id lists detokenized) on a thread so they do not hold up
other streams' steps.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Sequence
from dataclasses import replace

from base.logs import get_logger
from base.plan import SamplingParams
from base.tokenizer import Tokenizer
from control_plane import limits
from control_plane.errors import (
    EngineError,
    InvalidRequestError,
    RequestNotFoundError,
    WorkerUnavailableError,
)
from control_plane.images import check_image_count, expand_images
from control_plane.request import FinishReason, RequestOutput
from control_plane.request_stream import Chunk, RequestStream

log = get_logger("pagedkv.control")

# Texts longer than this are tokenized on a thread (tokenizers release the GIL), so a long
# prompt does not hold up every other stream's next step.
TOKENIZE_INLINE_CHARS = 16_384
DETOKENIZE_INLINE_IDS = 4_096  # the same for Detokenize's ids


class EngineRequests:
    """Mixin of `AsyncEngine`: everything a request handler calls, and output dispatch."""

    # -- requests ---------------------------------------------------------------------------
    async def submit(
        self,
        prompt_token_ids: Sequence[int] | None,
        text: str | None,
        sampling: SamplingParams,
        *,
        request_id: str = "",
        priority: int = 0,
        cache_salt: str = "",
        images: Sequence[bytes] = (),
        adapter: str = "",
    ) -> RequestStream:
        """Admit a request; raises an EngineError (mapped to a gRPC status by the service).
        Field sizes were checked where the request was decoded (api_codec); the text's length
        is checked here before tokenizing, the prompt's by the scheduler before scanning it."""
        self._require_available()
        adapter_id = self.adapters.resolve(adapter)  # NOT_FOUND naming it, before any work
        if (prompt_token_ids is None) == (text is None):
            raise InvalidRequestError("send exactly one of `text` and `token_ids`")
        if text is not None:
            if self.tokenizer is None:
                raise InvalidRequestError("this model has no tokenizer on the server; send `token_ids`")
            limits.check_text_size(len(text), self.scheduler.max_model_len)
            prompt_token_ids = await self._tokenize(text)
            if not prompt_token_ids:
                raise InvalidRequestError("the prompt text is empty; send at least one character")
            self._require_available()  # the worker may have gone while we tokenized
        if sampling.stop and self.tokenizer is None:
            raise InvalidRequestError("stop strings need a server-side tokenizer; use stop_token_ids")
        if sampling.structured is not None:  # compiled off the loop, before any block exists
            await self.grammar_check.check(sampling.structured)
            self._require_available()
        prompt_images = None
        if images or self.info.accepts_images:
            prompt_token_ids, prompt_images = await self._expand_images(list(prompt_token_ids), images)
        request_id = request_id or uuid.uuid4().hex
        adapter_id = self.adapters.resolve(adapter)  # unloaded while we tokenized: NOT_FOUND
        req = self.scheduler.add_request(
            request_id, prompt_token_ids, sampling, priority, cache_salt, prompt_images, adapter_id
        )
        stream = RequestStream(
            request_id, sampling.n, self.tokenizer, sampling.stop, req.arrival, sampling.min_tokens
        )
        self._streams[req.arrival] = stream
        self._work.set()
        log.debug(
            "request.added",
            request_id=limits.short(request_id),
            prompt_tokens=len(prompt_token_ids),
            n=sampling.n,
        )
        return stream

    def _require_available(self) -> None:
        if self._draining:
            raise WorkerUnavailableError("the server is shutting down; retry on another replica")
        if not self.available or self.scheduler is None:
            raise WorkerUnavailableError(
                f"no worker is connected (worker at {self.worker.target} is starting, restarting, "
                "down or not answering); retry shortly"
            )

    async def _expand_images(self, token_ids: list[int], images: Sequence[bytes]):
        """control_plane.images.expand_images, off the event loop when there are pixels to
        decode (a 10 MiB PNG takes ~0.1 s; other streams must not wait for it)."""
        if not images:
            return expand_images(token_ids, images, self.info)
        check_image_count(images)
        expanded = await asyncio.to_thread(expand_images, token_ids, images, self.info, self.image_sizes)
        self._require_available()  # the worker may have gone while we decoded
        return expanded

    async def _tokenize(self, text: str, add_special_tokens: bool = False) -> list[int]:
        if len(text) <= TOKENIZE_INLINE_CHARS:
            return self.tokenizer.encode(text, add_special_tokens)
        return await asyncio.to_thread(self.tokenizer.encode, text, add_special_tokens)

    # -- the Tokenize / Detokenize RPCs ------------------------------------------------------
    # They need the worker's tokenizer, not the worker: after a worker loss they keep
    # answering with the last one's (UNAVAILABLE only before any worker connected).
    def _require_tokenizer(self) -> Tokenizer:
        if self.info is None or self.scheduler is None:
            raise WorkerUnavailableError("no worker has connected yet; retry shortly")
        if self.tokenizer is None:
            raise InvalidRequestError("this model has no tokenizer on the server; tokenize on the client")
        return self.tokenizer

    async def tokenize(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """`text`'s ids as Generate computes them (with add_special_tokens: plus what the
        tokenizer's post-processor adds). InvalidRequestError past the text size limit."""
        self._require_tokenizer()
        limits.check_text_size(len(text), self.scheduler.max_model_len)
        return await self._tokenize(text, add_special_tokens)

    async def detokenize(
        self, token_ids: Sequence[int], skip_special_tokens: bool = False
    ) -> tuple[str, list[bytes], list[bool]]:
        """(text, each id's bytes, each id's special flag); InvalidRequestError for too many
        ids or one outside the vocabulary."""
        tok = self._require_tokenizer()
        limits.check_detokenize_ids(token_ids, self.info.vocab_size)
        ids = list(token_ids)

        def run() -> tuple[str, list[bytes], list[bool]]:
            text = tok.decode(ids, skip_special_tokens)
            return text, [tok.token_bytes(t) for t in ids], [tok.is_special(t) for t in ids]

        return run() if len(ids) <= DETOKENIZE_INLINE_IDS else await asyncio.to_thread(run)

    def abort(self, request_id: str, *, reason: FinishReason = FinishReason.ABORT) -> int:
        """End a live request now (blocks freed); returns the samples aborted. RequestNotFoundError."""
        if self.scheduler is None:
            raise RequestNotFoundError(f"no live request with id {request_id!r}")
        outputs = self.scheduler.abort_request(request_id, reason)
        self._dispatch(outputs)
        self._work.set()  # the worker must be told to drop the mirrors
        return len(outputs)

    def release(self, stream: RequestStream) -> None:
        """The client of `stream` went away (cancel, disconnect, deadline): abort its request
        quietly if still live. Keyed by the stream object, never by id alone: once a request
        finished its id may be reused by a new one, which must not be touched."""
        request_id = stream.request_id
        if self._streams.get(stream.arrival) is not stream:
            return  # already finished or failed
        del self._streams[stream.arrival]
        if stream.done or self.scheduler is None:
            return
        stream.done = True
        try:  # the scheduler may have retired it (its last outputs held) and the id been reused
            self.scheduler.abort_request(request_id, FinishReason.ABORT, arrival=stream.arrival)
        except EngineError:
            return
        self._work.set()
        log.info("request.cancelled", request_id=limits.short(request_id), tokens=stream.num_tokens)

    # -- outputs ----------------------------------------------------------------------------
    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        """Stream `outputs`, after any the loop still holds: those are older (an abort's
        finish, whose usage counts them, must not overtake them)."""
        if self._held_outputs:
            held, self._held_outputs = self._held_outputs, []
            outputs = held + outputs
        batches: dict[int, list[Chunk]] = {}
        for out in outputs:
            stream = self._streams.get(out.arrival)
            if stream is None:
                self.num_generation_tokens += len(out.new_token_ids)
                continue  # the client already went away
            chunk, dropped = stream.to_chunk(out)
            self.num_generation_tokens += len(chunk.token_ids)
            if dropped is not None:
                self._finish_on_stop(out, chunk, dropped)
            batches.setdefault(out.arrival, []).append(chunk)
        for arrival, chunks in batches.items():
            stream = self._streams[arrival]
            timings = stream.push(chunks)
            if self._observer is not None:
                self._observer.on_tokens(timings)
            if stream.done:
                del self._streams[arrival]
                self._log_finished(stream, chunks)

    def _finish_on_stop(self, out: RequestOutput, chunk: Chunk, dropped: int) -> None:
        """A stop string matched; the output's last `dropped` tokens came after it (a
        speculative verify's run): the sample ends without them, and its usage excludes them."""
        if out.finish_reason is None:
            ended = self.scheduler.finish_sample(out.request_id, out.index, FinishReason.STOP, dropped)
            if ended is not None:
                chunk.usage = ended.usage
            self._work.set()
        elif dropped and chunk.usage is not None:  # it ended in the same step (a stop id, length)
            chunk.usage = replace(chunk.usage, completion_tokens=chunk.usage.completion_tokens - dropped)
        chunk.finish_reason = FinishReason.STOP

    def _log_finished(self, stream: RequestStream, chunks: list[Chunk]) -> None:
        now = time.monotonic()
        ttft = (stream.first_token_at - stream.created) if stream.first_token_at else None
        reasons = sorted({c.finish_reason.name for c in chunks if c.finish_reason is not None})
        log.info(
            "request.finished",
            request_id=limits.short(stream.request_id),
            finish=",".join(reasons),
            tokens=stream.num_tokens,
            ttft_ms=round(ttft * 1e3, 1) if ttft is not None else None,
            total_ms=round((now - stream.created) * 1e3, 1),
        )
