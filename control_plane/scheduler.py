"""Continuous batching at iteration level: which sequences compute which tokens this step.

One step:

    schedule() ──▶ Plan ──▶ worker.execute(plan) ──▶ StepResult ──▶ update(plan, result)
       │ running first (decodes, then prefill chunks), preempting the lowest-priority,
       │ most recently admitted sequence when the pool runs dry; then waiting sequences
       │ (prefix-cache hits, chunked prefill) while budget, seats and blocks last.

A sequence's `num_computed_tokens` advances when it is scheduled; its sampled token arrives in
`update`. With overlap scheduling (the engine plans step k+1 before step k's result is in)
a sequence sampled in a step still in flight has a *pending* token (`Sequence.num_pending`,
one per such step); the next plan computes the newest one by `feed_last_sample` without
knowing it, unless the pending tokens will certainly end the sequence by length (then it
sits out the step). Stops found in `update(k)` are late by the plans in flight: the tokens
the worker sampled for a finished sequence in those plans are dropped there.

Blocks are allocated on demand (a new one only when the last is full); a sequence
preempted by recompute frees its blocks -- full ones stay cached -- and waits again with its
original arrival order, so its recompute usually hits the prefix cache.

Priority: lower value first, FCFS within a level; waiting order (priority, arrival);
preemption victims are taken from the end of `running`, sorted (priority, admitted_at).
A higher-priority arrival does not preempt running work (it goes first in the queue).
"""

from __future__ import annotations

import heapq
from collections.abc import Collection

from base.logs import get_logger
from base.plan import KVLayout, Plan, SamplingParams, WorkerInfo
from control_plane.beam_search import BeamSearch
from control_plane.block_hash import extra_keys as make_extra_keys
from control_plane.errors import (
    DuplicateRequestError,
    ResourceExhaustedError,
)
from control_plane.images import MAX_PLAN_IMAGE_BYTES, PromptImage
from control_plane.kv_cache_manager import Allocation, KVCacheManager
from control_plane.limits import short
from control_plane.request import FinishReason, Request, RequestOutput, SeqStatus, Sequence
from control_plane.request_checks import check_request
from control_plane.scheduler_beams import SchedulerBeams, to_compute
from control_plane.scheduler_config import SchedulerConfig
from control_plane.scheduler_emit import SchedulerEmit
from control_plane.scheduler_queries import SchedulerQueries
from control_plane.scheduler_update import SchedulerUpdate
from control_plane.speculation import Speculator
from control_plane.stats import AllocationRate

log = get_logger("pagedkv.scheduler")


class Scheduler(SchedulerBeams, SchedulerUpdate, SchedulerQueries, SchedulerEmit):
    def __init__(self, config: SchedulerConfig, worker_info: WorkerInfo) -> None:
        config.validate()
        self.config = config
        self.info = worker_info
        self.block_size = worker_info.block_size
        self.max_model_len = min(config.max_model_len or worker_info.max_model_len, worker_info.max_model_len)
        paged = worker_info.kv_layout == KVLayout.PAGED
        self.kv = KVCacheManager(
            worker_info.num_blocks,
            worker_info.block_size,
            enable_caching=config.enable_prefix_caching and paged,
            window=worker_info.sliding_window if paged else 0,
        )
        limits = [config.max_num_seqs]
        if config.policy == "latency":
            limits.append(config.latency_max_num_seqs)
        if worker_info.max_concurrent_seqs:
            limits.append(worker_info.max_concurrent_seqs)
        self.max_running = min(limits)
        self.requests: dict[str, Request] = {}
        self.seqs: dict[int, Sequence] = {}
        self.waiting: list[tuple[int, int, int, int]] = []  # heap of (priority, arrival, index, seq_id)
        self.num_waiting = 0
        self.running: list[Sequence] = []
        self._running_dirty = False  # needs re-sorting by (priority, admitted_at)
        self.pending_finished: list[int] = []  # synced seq ids the worker must drop
        self._next_seq_id = 1
        self._arrival = 0
        self.num_steps = 0
        self.num_preemptions = 0
        self.num_finished_requests = 0
        self._alloc_rate = AllocationRate()
        self._orphan_outputs: list[RequestOutput] = []  # produced by schedule(), returned by update()
        # Speculative decoding needs the paged layout: rollback cuts table entries.
        self.speculator = Speculator(config.speculative) if config.speculative.method and paged else None
        if config.speculative.method == "draft" and not worker_info.draft_model:
            self.speculator = None  # (`serve` refuses this pairing at start; a lone control logs it)
            log.warning("speculation.off", reason="--speculative draft, but the worker has no --draft-model")

    # -- admission ----------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Collection[int],
        sampling: SamplingParams,
        priority: int = 0,
        cache_salt: str = "",
        images: list[PromptImage] | None = None,
        adapter: str = "",
    ) -> Request:
        """Queue a request. Raises a control_plane.errors exception when it is wrong or can never run.
        `images`: control_plane.images.expand_images' output for these (expanded) prompt ids.
        `adapter`: a LoRA adapter id the worker has registered (control_plane/adapters.py)."""
        if request_id in self.requests:
            raise DuplicateRequestError(f"request id {short(request_id)!r} is already live; use a unique id")
        check_request(
            prompt_token_ids, sampling, self.config, self.info, self.max_model_len, self.max_running, self.kv
        )
        if self.num_waiting >= self.config.max_queue:
            raise ResourceExhaustedError(
                f"the waiting queue is full ({self.config.max_queue} requests); retry later"
            )
        self._arrival += 1
        stop_ids = set(sampling.stop_token_ids)
        req = Request(
            request_id,
            list(prompt_token_ids),
            sampling,
            priority,
            cache_salt,
            self._arrival,
            eos_token_ids=() if sampling.ignore_eos else tuple(self.info.eos_token_ids),
            extra_keys=make_extra_keys(cache_salt, adapter),
            images=list(images or ()),
            adapter=adapter,
        )
        req.stop_ids = frozenset(stop_ids.union(req.eos_token_ids))
        if sampling.is_beam_search:
            req.beam = BeamSearch(
                sampling.beam_width,
                sampling.length_penalty,
                sampling.max_tokens,
                req.stop_ids,
                sampling.early_stopping,
            )
        self.requests[request_id] = req
        self._enqueue(self._new_sequence(req, 0, list(prompt_token_ids)))
        return req

    def _new_sequence(self, req: Request, index: int, token_ids: list[int]) -> Sequence:
        seq = Sequence(self._next_seq_id, req, index, token_ids)
        self._next_seq_id += 1
        self.seqs[seq.seq_id] = seq
        req.sequences.append(seq)
        return seq

    def _fork(self, parent: Sequence, index: int, num_tokens: int) -> Sequence:
        """A new sequence of parent's request with parent's first `num_tokens` tokens, sharing
        the blocks that hold them (ref count += 1; writes into them copy on write). If the
        parent is not running (preempted while its step ran), or a sliding window released a
        block the child still reads (KVCacheManager.fork), the child waits to recompute."""
        child = self._new_sequence(parent.request, index, parent.token_ids[:num_tokens])
        child.num_cached_tokens = parent.num_cached_tokens
        child.block_hashes = list(parent.block_hashes)
        if parent.status == SeqStatus.RUNNING and self.kv.fork(parent, child, num_tokens):
            child.status = SeqStatus.RUNNING
            child.num_computed_tokens = num_tokens
            child.admitted_at = parent.admitted_at
            self.running.append(child)
            self._running_dirty = True
        else:
            self._enqueue(child)
        return child

    def _enqueue(self, seq: Sequence) -> None:
        req = seq.request
        heapq.heappush(self.waiting, (req.priority, req.arrival, seq.sample_index, seq.seq_id))
        self.num_waiting += 1

    def _peek_waiting(self) -> Sequence | None:
        while self.waiting:
            seq = self.seqs.get(self.waiting[0][3])
            if seq is not None and seq.status in (SeqStatus.WAITING, SeqStatus.PREEMPTED):
                return seq
            heapq.heappop(self.waiting)  # lazily drop entries of aborted sequences
        return None

    # -- scheduling ---------------------------------------------------------------------
    def schedule(self) -> Plan:
        plan = Plan(step_id=self.num_steps + 1)
        budget = self.config.max_num_batched_tokens
        self.kv.begin_plan()
        if self._running_dirty:
            self.running.sort(key=_running_order)
            self._running_dirty = False
        budget, preempted = self._schedule_running(plan, budget)
        if not preempted and self._may_admit():
            self._schedule_waiting(plan, budget)
        plan.finished = self.pending_finished
        self.pending_finished = []
        if not plan.is_empty():  # an empty plan is never sent: steps count the plans a worker runs
            self.num_steps += 1
        return plan

    def _chunk(self, seq: Sequence, budget: int) -> int:
        n = min(to_compute(seq), budget)
        cap = self.config.long_prefill_token_threshold
        return min(n, cap) if cap else n

    def _schedule_running(self, plan: Plan, budget: int) -> tuple[int, bool]:
        running = self.running
        # Decodes are reserved one token each so a long prefill chunk never starves them.
        reserve = sum(1 for s in running if to_compute(s) == 1)
        preempted = False
        i = 0
        while i < len(running) and budget > 0:
            seq = running[i]
            if seq.request.beam is not None:
                i, budget, reserve, group_preempted = self._schedule_beam_group(plan, i, budget, reserve)
                preempted = preempted or group_preempted
                continue
            is_decode = to_compute(seq) == 1
            if is_decode and seq.num_pending and self._reaches_length(seq, seq.num_tokens + seq.num_pending):
                reserve -= 1  # its pending token finishes it: nothing left to compute
                i += 1
                continue
            proposals: list[int] = []
            if is_decode:
                reserve -= 1
                if self.speculator is not None:
                    found = self.speculator.decide(
                        seq, len(running), budget - reserve - 1, self.max_model_len
                    )
                    if found is None:
                        i += 1  # sits this plan out (control_plane/speculation.py)
                        continue
                    proposals = found
                num_new = 1 + len(proposals)
            else:
                num_new = self._chunk(seq, max(budget - reserve, 0))
                if num_new == 0:
                    i += 1
                    continue
            alloc = self.kv.allocate_slots(seq, num_new)
            if alloc is None and proposals:  # speculation never preempts: decode plainly
                proposals, num_new = [], 1
                alloc = self.kv.allocate_slots(seq, num_new)
            while alloc is None and len(running) - 1 > i:
                reserve -= self._preempt_last()  # lowest priority, most recently admitted
                preempted = True
                alloc = self.kv.allocate_slots(seq, num_new)
            if alloc is None:
                running.pop(i)
                if i == 0:  # nothing else holds blocks: this sequence alone ran the pool dry
                    self._finish(seq, FinishReason.OUT_OF_MEMORY)
                    self._orphan_outputs.append(self._output(seq, []))
                else:
                    self._preempt(seq)
                preempted = True
                continue
            self._emit(plan, seq, num_new, alloc, proposals)
            budget -= num_new
            i += 1
        return budget, preempted

    def _may_admit(self) -> bool:
        if self.config.policy == "latency":
            # Finish running decodes before admitting new prefills (flat inter-token latency).
            return all(s.num_output_tokens == 0 for s in self.running)
        return True

    def _schedule_waiting(self, plan: Plan, budget: int) -> None:
        taken = self.num_seats_taken()
        image_bytes = 0  # encoded images this plan carries (the encoder budget, in bytes)
        adapters: set[str] | None = None  # of the running sequences, found when first needed
        while budget > 0:
            seq = self._peek_waiting()
            if seq is not None and seq.request.adapter:
                if adapters is None:
                    adapters = {s.request.adapter for s in self.running if s.request.adapter}
                if seq.request.adapter not in adapters and len(adapters) >= self.info.max_loras:
                    return  # the worker holds max_loras adapters at once: FCFS, it waits
                adapters.add(seq.request.adapter)
            if seq is not None and seq.request.beam is not None:
                admitted = self._admit_beam_group(plan, seq.request, budget, taken)
                if admitted is None:
                    return  # FCFS: the group blocks the queue like any head
                budget -= admitted[0]
                taken += admitted[1]
                continue
            if seq is None or seq.num_pending:
                return  # (a sequence preempted while its sample was in flight waits for it)
            seats = _seats(seq)
            if taken + seats > self.max_running:
                return
            hits, num_hit = self.kv.get_computed_blocks(seq)
            if self.kv.prefix_being_filled(seq, len(hits)):
                return  # next plan it hits what this one computes (FCFS: nobody overtakes)
            num_new = min(seq.num_tokens - num_hit, budget)
            cap = self.config.long_prefill_token_threshold
            num_new = min(num_new, cap) if cap else num_new
            seq_image_bytes = seq.request.image_bytes_to_send(num_hit) if seq.request.images else 0
            if image_bytes and image_bytes + seq_image_bytes > MAX_PLAN_IMAGE_BYTES:
                return  # its images go in the next plan (FCFS), keeping a plan's size bounded
            alloc = self.kv.allocate_slots(seq, num_new, hits)
            if alloc is None:
                return  # head-of-line blocks: FCFS, no overtaking by smaller requests
            image_bytes += seq_image_bytes
            heapq.heappop(self.waiting)
            self.num_waiting -= 1
            self._admit(plan, seq, num_hit, num_new, alloc)
            budget -= num_new
            taken += seats

    def _admit(self, plan: Plan, seq: Sequence, num_hit: int, num_new: int, alloc: Allocation) -> None:
        """A waiting sequence starts running with its prefix hits and first chunk allocated."""
        self.kv.record_prefix_lookup(seq.num_tokens, num_hit)
        if seq.num_cached_tokens < 0:
            seq.num_cached_tokens = num_hit
        seq.status = SeqStatus.RUNNING
        seq.admitted_at = plan.step_id
        seq.num_computed_tokens = num_hit
        self.running.append(seq)
        self._running_dirty = True
        self._emit(plan, seq, num_new, alloc)

    def num_seats_taken(self) -> int:
        """Running sequences plus the samples that running n > 1 prompts will fork into.

        Invariant: <= max_running (max_num_seqs). Counting only `len(running)` let a running
        unforked n > 1 prompt's future samples go unreserved: 8 seats held 11 sequences once
        it forked (found by the CI soak)."""
        return sum(_seats(s) for s in self.running)

    def _preempt(self, seq: Sequence) -> None:
        """Recompute preemption: free the blocks (full ones stay cached) and wait again."""
        self.kv.free(seq)
        seq.num_computed_tokens = 0
        seq.beam_candidates = None  # a beam asks again at the end of its recompute
        seq.status = SeqStatus.PREEMPTED
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self._unsync(seq)
        self._enqueue(seq)

    def _unsync(self, seq: Sequence) -> None:
        if seq.synced:
            self.pending_finished.append(seq.seq_id)
        seq.synced = False
        seq.num_synced_blocks = 0


def _running_order(seq: Sequence) -> tuple[int, int, int]:
    """Priority, then admission step; a beam's request serial last keeps a beam group
    contiguous (scheduler_beams). Other sequences keep their order among equals (stable sort)."""
    req = seq.request
    return req.priority, seq.admitted_at, req.arrival if req.beam is not None else 0


def _seats(seq: Sequence) -> int:
    """Seats a sequence holds: n (beam search: beam_width) for a prompt that has not forked
    yet, else 1."""
    req = seq.request
    width = req.sampling.beam_width if req.beam is not None else req.sampling.n
    return width if (width > 1 and not req.forked) else 1
