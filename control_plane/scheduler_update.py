"""The second half of a step: folding the worker's sampled tokens back into sequences.

`update` appends tokens, forks n > 1 requests at their fan-out, stops sequences (EOS, stop
token ids, max_tokens, max model length), frees finished ones, caches newly full blocks, and
returns one `RequestOutput` per sample that produced a token or finished. Aborts and
engine-side stops (stop strings) end samples through the same `_finish` path.

Overlap scheduling: by the time `update(k)` runs, step k+1 is planned (and maybe running).
A token for a sequence that finished meanwhile is dropped (never appended, counted or
hashed); one for a sequence preempted meanwhile is kept (it was sampled from a valid
context, and its recompute includes it).
"""

from __future__ import annotations

from base.plan import Plan, StepResult
from control_plane.errors import RequestNotFoundError
from control_plane.limits import short
from control_plane.request import (
    FinishReason,
    PromptTokenLogprob,
    Request,
    RequestOutput,
    SeqStatus,
    Sequence,
    Usage,
)


class SchedulerUpdate:
    """Mixin of `Scheduler`: everything that happens after the worker answered."""

    def update(self, plan: Plan, result: StepResult) -> list[RequestOutput]:
        if result.step_id != plan.step_id:
            raise AssertionError(f"result of step {result.step_id} applied to plan {plan.step_id}")
        seqs = self.seqs
        # The step ran: every slot scheduled is now computed, so full blocks become cacheable
        # (with overlap also slots of the step in flight: the worker runs plans in order, so
        # their K/V is written before any later plan can read a cache hit).
        if self.kv.enable_caching:
            for item in (*plan.new, *plan.continuing):
                seq = seqs.get(item.seq_id)
                if seq is not None and seq.status == SeqStatus.RUNNING:
                    self.kv.cache_full_blocks(seq)
        outputs, self._orphan_outputs = self._orphan_outputs, []
        for entry in result.prompt_logprobs:
            self._record_prompt_logprobs(entry)
        any_finished = False
        beam_requests: dict[int, Request] = {}
        for out in result.outputs:
            seq = seqs.get(out.seq_id)
            if seq is None or seq.status == SeqStatus.FINISHED:
                continue  # aborted, or stopped by an earlier step's token (overlap): dropped
            seq.num_pending -= 1
            if seq.spec_in_flight:
                any_finished = self._apply_verified(seq, out, outputs) or any_finished
                continue
            if seq.request.beam is not None:
                if seq.status == SeqStatus.RUNNING:  # (a preempted beam asks again)
                    seq.beam_candidates = list(zip(out.token_ids, out.logprobs or (), strict=True))
                    beam_requests[id(seq.request)] = seq.request
                continue
            token_ids = out.token_ids
            logprobs = out.logprobs
            tops = _split_tops(out, len(token_ids))
            if len(token_ids) > 1:
                child_tops = tops[1:] if tops else None
                if self._fan_out(seq, token_ids[1:], logprobs[1:] if logprobs else None, outputs, child_tops):
                    any_finished = True
                token_ids = token_ids[:1]
                logprobs = logprobs[:1] if logprobs else None
                tops = tops[:1] if tops else None
            if self._append(seq, token_ids[0]):
                any_finished = True
            outputs.append(self._output(seq, token_ids, logprobs, tops))
        for req in beam_requests.values():
            if self.requests.get(req.request_id) is req:
                outputs.extend(self._select_beams(req))
                any_finished = True  # beams were dropped or forked
        if any_finished:
            self.running = [s for s in self.running if s.status == SeqStatus.RUNNING]
        return outputs

    def _apply_verified(self, seq: Sequence, out, outputs: list[RequestOutput]) -> bool:
        """A speculative verify's result: its accepted proposals and the token after them
        (control_plane/speculation.py). Appended in order up to a stop (the rest are dropped,
        never streamed or counted); then the rejected positions are rolled back: computed
        tokens = the step's first position + tokens returned, and blocks past them go back
        to the pool now (the worker cut its mirror by the same rule). True if it finished."""
        num_spec, seq.spec_in_flight = seq.spec_in_flight, 0
        start = seq.num_tokens - 1  # the step's first input: the newest token known then
        tokens = out.token_ids
        if not 1 <= len(tokens) <= num_spec + 1:
            raise AssertionError(f"sequence {seq.seq_id}: verify of {num_spec} returned {len(tokens)} tokens")
        self.speculator.record(seq, num_spec, len(tokens) - 1)
        finished = False
        kept = 0
        for token in tokens:
            kept += 1
            if self._append(seq, token):
                finished = True
                break
        if seq.status == SeqStatus.RUNNING:  # (preempted meanwhile: it holds no blocks)
            seq.num_computed_tokens = start + len(tokens)
            seq.num_synced_blocks = min(seq.num_synced_blocks, self.kv.truncate(seq, seq.num_computed_tokens))
        tops = _split_tops(out, len(tokens))
        outputs.append(
            self._output(
                seq, tokens[:kept], out.logprobs[:kept] if out.logprobs else None, tops and tops[:kept]
            )
        )
        return finished

    def _record_prompt_logprobs(self, entry) -> None:
        """Prompt logprobs of one chunk; positions already recorded (a preempted sequence
        recomputes its prompt) are ignored."""
        seq = self.seqs.get(entry.seq_id)
        if seq is None:
            return
        have = seq.request.prompt_logprobs
        k = len(entry.top_ids) // len(entry.logprobs) if entry.top_ids else 0
        for i, value in enumerate(entry.logprobs):
            if entry.first + i == len(have) + 1:  # positions arrive in order; entry p-1 is position p
                top = (
                    (entry.top_ids[i * k : (i + 1) * k], entry.top_logprobs[i * k : (i + 1) * k])
                    if k
                    else ([], [])
                )
                have.append(PromptTokenLogprob(seq.request.prompt_token_ids[entry.first + i], value, *top))

    def _append(self, seq: Sequence, token: int) -> bool:
        """Append one sampled token; finish the sequence if it hit a stop. True if finished."""
        seq.token_ids.append(token)
        if token in seq.request.stop_ids and seq.num_output_tokens > seq.request.sampling.min_tokens:
            reason = FinishReason.STOP
        elif self._reaches_length(seq, seq.num_tokens):
            reason = FinishReason.LENGTH
        else:
            return False
        self._finish(seq, reason)
        return True

    def _reaches_length(self, seq: Sequence, num_tokens: int) -> bool:
        """`num_tokens` tokens would end `seq` by max_tokens or the model's max length."""
        return (
            num_tokens - seq.num_prompt_tokens >= seq.request.sampling.max_tokens
            or num_tokens >= self.max_model_len
        )

    def _fan_out(
        self, parent: Sequence, tokens: list[int], logprobs, outputs: list[RequestOutput], tops=None
    ) -> bool:
        """n > 1: children share every prompt block of the parent (copy-on-write later).

        Returns True if a child finished on its very first token (EOS, a stop id, max_tokens 1):
        it is already freed, and the caller must drop it from `running` -- left there, the
        next step would give it blocks that nothing ever frees."""
        req = parent.request
        req.forked = True
        any_finished = False
        num_prompt = req.num_prompt_tokens
        for i, token in enumerate(tokens, start=1):
            # Only the prompt's blocks: with overlap the parent may already hold a block for
            # its next position, which the child would have to copy-on-write.
            child = self._fork(parent, i, num_prompt)
            if self._append(child, token):
                any_finished = True
            top = [tops[i - 1]] if tops else None
            outputs.append(self._output(child, [token], [logprobs[i - 1]] if logprobs else None, top))
        return any_finished

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        if seq.status == SeqStatus.FINISHED:
            return
        if seq.status in (SeqStatus.WAITING, SeqStatus.PREEMPTED):
            self.num_waiting -= 1  # its heap entry is dropped lazily
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        self.kv.free(seq)
        self._unsync(seq)
        req = seq.request
        req.num_finished += 1
        if req.num_finished >= req.sampling.n:
            self._retire(req)

    def _retire(self, req: Request) -> None:
        self.requests.pop(req.request_id, None)
        for s in req.sequences:
            self.seqs.pop(s.seq_id, None)
        self.num_finished_requests += 1

    def _output(self, seq: Sequence, token_ids: list[int], logprobs=None, tops=None) -> RequestOutput:
        usage = None
        if seq.status == SeqStatus.FINISHED:
            usage = Usage(seq.num_prompt_tokens, seq.num_output_tokens, max(seq.num_cached_tokens, 0))
        req = seq.request
        out = RequestOutput(
            req.request_id, seq.sample_index, list(token_ids), logprobs, seq.finish_reason, usage, req.arrival
        )
        out.top_logprobs = tops
        if req.sampling.prompt_logprobs is not None and token_ids and not seq.prompt_logprobs_sent:
            seq.prompt_logprobs_sent = True
            first = PromptTokenLogprob(req.prompt_token_ids[0], None)
            out.prompt_logprobs = [first, *req.prompt_logprobs]
        return out

    # -- ending samples from outside the step -------------------------------------------
    def _get(self, request_id: str) -> Request:
        req = self.requests.get(request_id)
        if req is None:
            raise RequestNotFoundError(
                f"no live request with id {short(request_id)!r} (finished, aborted or never sent)"
            )
        return req

    def abort_request(
        self, request_id: str, reason: FinishReason = FinishReason.ABORT, arrival: int | None = None
    ) -> list[RequestOutput]:
        """End every unfinished sample of a request; blocks are freed now, and the worker is
        told to drop its mirrors in the next plan. `arrival`: only if the live request with
        this id is that one (not a later request that reused the id). Raises RequestNotFoundError."""
        req = self._get(request_id)
        if arrival is not None and req.arrival != arrival:
            raise RequestNotFoundError(f"request {short(request_id)!r} already ended; its id was reused")
        if req.beam is not None:
            outputs = self._end_beams(req, reason)
            self.running = [s for s in self.running if s.status == SeqStatus.RUNNING]
            return outputs
        outputs = []
        for seq in list(req.sequences):
            if seq.status != SeqStatus.FINISHED:
                self._finish(seq, reason)
                outputs.append(self._output(seq, []))
        # Samples of an n > 1 request that were never forked end too.
        for index in range(len(req.sequences), req.sampling.n):
            outputs.append(
                RequestOutput(
                    req.request_id, index, [], None, reason, Usage(req.num_prompt_tokens, 0, 0), req.arrival
                )
            )
        if req.request_id in self.requests:
            self._retire(req)
        self.running = [s for s in self.running if s.status == SeqStatus.RUNNING]
        return outputs

    def finish_sample(
        self, request_id: str, index: int, reason: FinishReason, drop: int = 0
    ) -> RequestOutput | None:
        """End one sample (e.g. a stop string matched by the engine). None if already ended.
        `drop`: its last this many tokens came after the stop string (the rest of a speculative
        verify's accepted run); they leave its output, so usage counts up to the stop only."""
        req = self._get(request_id)
        if req.beam is not None or not 0 <= index < len(req.sequences):
            return None  # (beam search takes no stop strings: nothing to end per index)
        seq = req.sequences[index]
        if seq.status == SeqStatus.FINISHED:
            return None
        self._finish(seq, reason)
        if drop:  # (after its blocks were freed: a finished sequence's tokens are only counted)
            del seq.token_ids[len(seq.token_ids) - min(drop, seq.num_output_tokens) :]
        self.running = [s for s in self.running if s.status == SeqStatus.RUNNING]
        return self._output(seq, [])

    def abort_all(self, reason: FinishReason = FinishReason.ABORT) -> list[RequestOutput]:
        outputs = []
        for request_id in list(self.requests):
            outputs.extend(self.abort_request(request_id, reason))
        return outputs


def _split_tops(out, num_tokens: int) -> list[tuple[list[int], list[float]]] | None:
    """SeqOutput's flattened alternatives (k per token) as one (ids, logprobs) per token."""
    if not out.top_ids:
        return None
    k = len(out.top_ids) // num_tokens
    return [
        (out.top_ids[i * k : (i + 1) * k], out.top_logprobs[i * k : (i + 1) * k]) for i in range(num_tokens)
    ]
