"""How the scheduler writes a sequence it scheduled into the step's Plan (a mixin of
`Scheduler`, like SchedulerUpdate): a sequence the worker has no mirror of yet goes in
`plan.new` with its whole block table and what its sampling needs (history for penalties and
grammars, images, adapter); a synced one goes in `plan.continuing` with only the blocks added
since the last plan (`num_synced_blocks`), a copy-on-write replacement, and whether its input
is the newest pending sample (`feed_last_sample`, overlap scheduling)."""

from __future__ import annotations

from base.plan import ContinuingSequence, NewSequence, Plan
from control_plane.kv_cache_manager import Allocation
from control_plane.request import Sequence
from control_plane.speculation import DRAFT_SLOT


class SchedulerEmit:
    """Mixin of `Scheduler`: `self.kv` (KVCacheManager)."""

    def _emit(
        self, plan: Plan, seq: Sequence, num_new: int, alloc: Allocation, proposals: list[int] = ()
    ) -> None:
        """`proposals`: a speculative verify's (its inputs: the newest known token, then them)."""
        start = seq.num_computed_tokens
        feed = start >= seq.num_tokens  # its input is the newest pending sample (overlap)
        num_spec = len(proposals)
        drafted = False
        tokens = [] if feed else seq.token_ids[start : start + num_new - num_spec]
        if num_spec:
            if feed or not seq.synced:
                raise AssertionError(f"sequence {seq.seq_id}: speculating without its input token known")
            drafted = proposals[0] == DRAFT_SLOT  # the worker's draft fills them
            if not drafted:
                tokens.extend(proposals)
            seq.spec_in_flight = num_spec
        seq.num_computed_tokens = start + num_new
        sample = num_spec > 0 or seq.num_computed_tokens == seq.num_tokens + seq.num_pending
        if sample:
            seq.num_pending += 1
        table = self.kv.tables[seq.seq_id]
        if alloc.copies:
            plan.copies.extend(alloc.copies)
        req = seq.request
        fan_out = 1
        candidates = req.beam.num_candidates if (sample and req.beam is not None) else 0
        if sample and req.sampling.n > 1 and not req.fan_out_planned and not candidates:
            fan_out, req.fan_out_planned = req.sampling.n, True
        if not seq.synced:
            if feed:
                raise AssertionError(f"sequence {seq.seq_id}: a pending sample fed to an unsynced mirror")
            plan.new.append(
                NewSequence(
                    seq.seq_id,
                    [b.block_id for b in table],
                    tokens,
                    start,
                    req.sampling,
                    sample,
                    seq.sample_index,
                    fan_out,
                    candidates,
                    req.num_prompt_tokens,
                    seq.token_ids[:start] if _needs_history(req.sampling) else [],
                    _next_prompt_token(seq, start + len(tokens)),
                    [image.for_plan(start) for image in req.images],
                    req.adapter,
                )
            )
            seq.synced = True
        else:
            synced = seq.num_synced_blocks
            new_ids = [b.block_id for b in table[synced:]] if len(table) > synced else []
            plan.continuing.append(
                ContinuingSequence(
                    seq.seq_id,
                    new_ids,
                    alloc.replaced,
                    tokens,
                    start,
                    sample,
                    fan_out,
                    feed,
                    candidates,
                    _next_prompt_token(seq, start + len(tokens)),
                    num_speculative_tokens=0 if drafted else num_spec,
                    num_draft_tokens=num_spec if drafted else 0,
                    num_released_blocks=self.kv.num_released.get(seq.seq_id, 0),
                )  # fmt: skip
            )
        seq.num_synced_blocks = len(table)
        self.kv.note_scheduled(seq)


def _next_prompt_token(seq: Sequence, end: int) -> int | None:
    """Prompt logprobs: the token after a chunk that ends inside the prompt (its last position
    predicts it); None when not asked or the chunk reaches the prompt's end."""
    if seq.request.sampling.prompt_logprobs is None or end >= seq.num_prompt_tokens:
        return None
    return seq.token_ids[end]


def _needs_history(sampling) -> bool:
    """Penalties count the tokens before start_pos; a constrained sequence replays the generated
    ones among them into a fresh grammar matcher (a resumed sequence's prefix-cache hits)."""
    return sampling.has_penalties or sampling.structured is not None
