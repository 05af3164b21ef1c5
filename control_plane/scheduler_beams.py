"""Beam search in the scheduler: a request's live beams are scheduled, preempted and admitted
as one group, and forked or dropped by each step's selection (control_plane.beam_search).

A beam request starts as one sequence (the prompt). Each beam, once computed up to its last
token, asks the worker for its top candidates (`num_candidates`) instead of a sample, and then
waits (`Sequence.beam_candidates`). When every live beam of the group has its candidates, the
selection runs in `update`: a beam with one surviving child simply appends the token; one with
k > 1 children forks k - 1 new sequences that share its whole block table (ref count += 1); a
beam with none is dropped and its blocks go back to the pool the moment no one else refers to
them. The next step the children write their token: into a new block if the last is full,
else into the shared partial last block, which allocate_slots copies for every writer but the
last (copy-on-write: k - 1 copies of one block, never of the prefix).

Group invariants (what makes a coupled group deadlock-free):
  - a group is entirely running or entirely waiting: preempting one beam preempts its group
    (victims are taken from the end of `running`, where a group is contiguous: running is
    sorted by (priority, admitted_at, the beam request's arrival)), and waiting beams are
    admitted together;
  - a running group's step allocates for all its beams or none (`_schedule_beam_group`);
  - a group alone always fits: admission requires beam_width x blocks(prompt + max_tokens)
    <= the pool, an upper bound of its distinct blocks.
A preempted beam drops its candidates (its recompute asks again: same context, same result).

Beams never use `feed_last_sample`: their next token is the control plane's choice, so a beam
sits out plans made while its candidates are in flight. With overlap scheduling a beam group
therefore steps every other plan while other requests keep the worker busy, and every plan
when it runs alone (the plan in between is empty and never sent).
"""

from __future__ import annotations

import heapq

from base.plan import Plan
from control_plane.beam_search import Beam, Continuation
from control_plane.kv_cache_manager import KVCacheManager
from control_plane.request import FinishReason, Request, RequestOutput, SeqStatus, Sequence, Usage


class SchedulerBeams:
    """Mixin of `Scheduler` (which provides kv, running, seqs, waiting and the helpers used)."""

    kv: KVCacheManager
    running: list[Sequence]

    # -- scheduling a running group -------------------------------------------------------
    def _schedule_beam_group(
        self, plan: Plan, i: int, budget: int, reserve: int
    ) -> tuple[int, int, int, bool]:
        """Schedule the group starting at running[i]: every beam with work gets its tokens, or
        none does. Returns (next index, budget, reserve, whether anything was preempted)."""
        running = self.running
        req = running[i].request
        j = i
        while j < len(running) and running[j].request is req:
            j += 1
        work = [(s, n) for s in running[i:j] if (n := to_compute(s)) > 0]
        num_decodes = sum(1 for _, n in work if n == 1)
        reserve -= num_decodes  # the group's decodes are scheduled (or skipped) now
        if not work or budget - reserve < len(work):
            return j, budget, reserve, False
        prefills = len(work) - num_decodes
        if prefills:
            share = max((budget - reserve - num_decodes) // prefills, 1)
            cap = self.config.long_prefill_token_threshold
            work = [(s, n if n == 1 else min(n, share, cap or n)) for s, n in work]
        preempted = False
        for seq, _ in work:  # a sliding window: what the group frees counts before what it takes
            self.kv.release_before_window(seq)
        while self.kv.num_blocks_to_allocate(work) > self.kv.pool.num_free_blocks and len(running) > j:
            reserve -= self._preempt_last()
            preempted = True
        if self.kv.num_blocks_to_allocate(work) > self.kv.pool.num_free_blocks:
            del running[i:j]
            if i == 0:  # alone and still short: cannot happen within the admission bound
                self._orphan_outputs.extend(self._end_beams(req, FinishReason.OUT_OF_MEMORY))
            else:
                for seq in req.sequences:
                    self._preempt(seq)
            return i, budget, reserve, True
        for seq, n in work:
            alloc = self.kv.allocate_slots(seq, n)
            if alloc is None:
                raise AssertionError(f"beam {seq.seq_id}: allocation failed after the group's count")
            self._emit(plan, seq, n, alloc)
            budget -= n
        return j, budget, reserve, preempted

    def _preempt_last(self) -> int:
        """Preempt running[-1] and, if it is a beam, its whole group (contiguous at the end).
        Returns the number of decodes among them (the reserve they held)."""
        victim = self.running.pop()
        removed = [victim]
        if victim.request.beam is not None:
            while self.running and self.running[-1].request is victim.request:
                removed.append(self.running.pop())
        decodes = sum(1 for s in removed if to_compute(s) == 1)
        for seq in removed:
            self._preempt(seq)
        return decodes

    # -- admitting a waiting group ------------------------------------------------------
    def _admit_beam_group(self, plan: Plan, req: Request, budget: int, taken: int) -> tuple[int, int] | None:
        """Admit every waiting beam of `req` in this plan, or none (None). Returns (tokens
        scheduled, seats taken). Beams skip the wait for prefixes being filled: each computes
        what it misses, so the group never waits on itself."""
        members = [s for s in req.sequences if s.status in (SeqStatus.WAITING, SeqStatus.PREEMPTED)]
        if any(s.num_pending for s in members) or budget < len(members):
            return None  # (samples still in flight come back first)
        seats = len(members) if req.forked else req.sampling.beam_width
        if taken + seats > self.max_running:
            return None
        share = budget // len(members)
        cap = self.config.long_prefill_token_threshold
        chunks = []
        revived: dict[int, object] = {}
        need = 0
        for seq in members:
            hits, num_hit = self.kv.get_computed_blocks(seq)
            n = min(seq.num_tokens - num_hit, share, cap or share)
            chunks.append((seq, hits, num_hit, n))
            need += self.kv.num_blocks_needed(num_hit + n) - len(hits)
            revived.update((b.block_id, b) for b in hits if b.ref_cnt == 0 and b.block_id)  # (0: released)
        if need + len(revived) > self.kv.pool.num_free_blocks:
            return None
        self._pop_waiting(req, len(members))
        # Every member's hits are held before any member takes new blocks: a free cached block
        # that one member hits could otherwise be evicted and handed to another as a fresh
        # block, and the two would then write into one block (found by the 64-client soak).
        shared_hits = {b.block_id: b for _, hits, _, _ in chunks for b in hits}.values()
        self.kv.pool.touch(shared_hits)
        tokens = 0
        for seq, hits, num_hit, n in chunks:
            alloc = self.kv.allocate_slots(seq, n, hits)
            if alloc is None:
                raise AssertionError(f"beam {seq.seq_id}: admission failed after the group's count")
            self._admit(plan, seq, num_hit, n, alloc)
            tokens += n
        self.kv.pool.free_blocks(shared_hits)  # the members hold them now
        return tokens, seats

    def _pop_waiting(self, req: Request, count: int) -> None:
        """Pop the heap entries of `count` waiting beams of `req`: they are on top (same
        priority and arrival), possibly mixed with stale entries of dropped beams."""
        while count:
            _, _, _, seq_id = heapq.heappop(self.waiting)
            seq = self.seqs.get(seq_id)
            if (
                seq is not None
                and seq.request is req
                and seq.status in (SeqStatus.WAITING, SeqStatus.PREEMPTED)
            ):
                count -= 1
                self.num_waiting -= 1

    # -- selection ----------------------------------------------------------------------
    def _select_beams(self, req: Request) -> list[RequestOutput]:
        """Run the selection once every live beam has its candidates; fork, extend and drop
        beams; end the request when the search is done."""
        live = list(req.sequences)  # (forks below are appended to req.sequences)
        if any(s.beam_candidates is None or s.status != SeqStatus.RUNNING for s in live):
            return []
        prompt = req.num_prompt_tokens
        beams = [Beam(s.token_ids[prompt:], s.beam_logprobs, s.cumulative_logprob) for s in live]
        chosen = req.beam.step(beams, [s.beam_candidates for s in live])
        for s in live:
            s.beam_candidates = None
        req.forked = True
        if req.beam.done:
            return self._end_beam_search(req)
        # Forks first: a child copies its parent's tokens before the parent extends its own.
        first_child: dict[int, Continuation] = {}
        next_live: list[Sequence] = []
        for cont in chosen:
            if cont.parent not in first_child:
                first_child[cont.parent] = cont
                next_live.append(live[cont.parent])
            else:
                next_live.append(self._fork_beam(live[cont.parent]))
        for seq, cont in zip(next_live, chosen, strict=True):
            seq.token_ids.append(cont.token)
            seq.beam_logprobs.append(cont.logprob)
            seq.cumulative_logprob = cont.cumulative_logprob
        for index, seq in enumerate(live):
            if index not in first_child:
                self._drop_beam(seq)
        for index, seq in enumerate(next_live):
            seq.sample_index = index
        req.sequences = next_live
        return []

    def _fork_beam(self, parent: Sequence) -> Sequence:
        child = self._fork(parent, 0, parent.num_tokens)  # a running parent: all tokens computed
        child.beam_logprobs = list(parent.beam_logprobs)
        return child

    def _drop_beam(self, seq: Sequence) -> None:
        """A beam that died (or whose search ended): its blocks are released now."""
        if seq.status in (SeqStatus.WAITING, SeqStatus.PREEMPTED):
            self.num_waiting -= 1  # its heap entry is dropped lazily
        seq.status = SeqStatus.FINISHED
        self.kv.free(seq)
        self._unsync(seq)
        self.seqs.pop(seq.seq_id, None)

    # -- ending -------------------------------------------------------------------------
    def _end_beam_search(self, req: Request) -> list[RequestOutput]:
        """The n best finished beams, best first, then the request retires."""
        cached = max(req.sequences[0].num_cached_tokens, 0) if req.sequences else 0
        for seq in req.sequences:
            self._drop_beam(seq)
        outputs = []
        for index, h in enumerate(req.beam.finished[: req.sampling.n]):
            reason = FinishReason.STOP if h.stopped else FinishReason.LENGTH
            logprobs = h.logprobs if req.sampling.logprobs else None
            usage = Usage(req.num_prompt_tokens, len(h.token_ids), cached)
            outputs.append(
                RequestOutput(
                    req.request_id,
                    index,
                    h.token_ids,
                    logprobs,
                    reason,
                    usage,
                    req.arrival,
                    h.cumulative_logprob,
                    h.score,
                )
            )
        self._retire_beams(req)
        return outputs

    def _end_beams(self, req: Request, reason: FinishReason) -> list[RequestOutput]:
        """Abort (or out of memory): every returned index ends with `reason`, no tokens."""
        for seq in req.sequences:
            if seq.status != SeqStatus.FINISHED:
                self._drop_beam(seq)
        usage = Usage(req.num_prompt_tokens, 0, 0)
        outputs = [
            RequestOutput(req.request_id, index, [], None, reason, usage, req.arrival)
            for index in range(req.sampling.n)
        ]
        self._retire_beams(req)
        return outputs

    def _retire_beams(self, req: Request) -> None:
        req.sequences = []
        req.num_finished = req.sampling.n
        self._retire(req)  # (callers drop the finished beams from `running`)


def to_compute(seq: Sequence) -> int:
    """Tokens (known or pending) whose K/V are not computed yet: 1 for a decode. 0 for a beam
    waiting for its group's selection (candidates in flight or held) and for a sequence whose
    speculative verify is in flight."""
    if seq.beam_candidates is not None or (seq.num_pending and seq.request.beam is not None):
        return 0
    if seq.spec_in_flight:
        return 0  # how many of its positions survive is unknown until the verify's result
    return seq.num_tokens + seq.num_pending - seq.num_computed_tokens
