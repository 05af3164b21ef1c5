"""Executable forms of DESIGN.md §4's invariants. Tests run them after every operation;
`PAGEDKV_CHECK_INVARIANTS=1` makes the engine run them after every step (slow, for debugging).

Each checker raises AssertionError with a message naming the broken invariant.
"""

from __future__ import annotations

from collections import Counter

from base.plan import NULL_BLOCK_ID, Plan
from control_plane.block_pool import BlockPool
from control_plane.request import SeqStatus


def check_pool(pool: BlockPool) -> None:
    null = pool.null_block
    if null.ref_cnt != 0 or null.prev_free is not None or null.block_hash is not None:
        raise AssertionError(f"null block was handed out, queued or cached: {null}")
    in_queue = list(pool.free_queue)
    if len(in_queue) != pool.free_queue.num_free_blocks:
        raise AssertionError("free queue length differs from its counter")
    queued_ids = {b.block_id for b in in_queue}
    for block in pool.blocks[1:]:
        if (block.block_id in queued_ids) != (block.ref_cnt == 0):
            raise AssertionError(f"in free queue <=> ref count 0 broken for {block}")
        if block.ref_cnt < 0:
            raise AssertionError(f"negative ref count: {block}")
        if block.block_hash is not None and pool.cached.get(block.block_hash) is not block:
            raise AssertionError(f"hashed block missing from the cache index: {block}")
    for block_hash, block in pool.cached.items():
        if block.block_hash != block_hash:
            raise AssertionError(f"cache index entry points at a block with another hash: {block}")
    seen_cached = False
    for block in in_queue:  # eviction order: uncached free blocks before cached ones
        if block.block_hash is not None:
            seen_cached = True
        elif seen_cached:
            raise AssertionError(f"uncached free block {block} queued behind a cached one")


def check_scheduler(sched) -> None:
    """Pool invariants + table accounting + sequence states, for a `Scheduler`."""
    kv = sched.kv
    pool = kv.pool
    check_pool(pool)
    refs = Counter()
    for seq_id, table in kv.tables.items():
        seq = sched.seqs.get(seq_id)
        if seq is None or seq.status != SeqStatus.RUNNING:
            raise AssertionError(f"sequence {seq_id} holds a table but is not running")
        check_released(kv, seq, table)
        for block in table[kv.num_released.get(seq_id, 0) :]:
            if block.block_id == NULL_BLOCK_ID:
                raise AssertionError(
                    f"sequence {seq_id} table contains the null block past its released entries"
                )
            refs[block.block_id] += 1
        if len(table) * kv.block_size < seq.num_computed_tokens:
            raise AssertionError(f"sequence {seq_id}: table too short for its computed tokens")
        if len(table) > kv.num_blocks_needed(seq.num_computed_tokens):
            raise AssertionError(
                f"sequence {seq_id}: {len(table)} blocks for {seq.num_computed_tokens} computed tokens "
                "(a block no computed position reached: a rejected proposal's, not rolled back)"
            )
        if kv.num_cached_blocks.get(seq_id, 0) * kv.block_size > seq.num_tokens:
            raise AssertionError(f"sequence {seq_id}: a cached block holds a token not yet accepted")
        bs = kv.block_size
        for i, block in enumerate(table):
            # Only full, computed blocks are hashed; a hash matches this sequence's content.
            if block.block_hash is not None and i < kv.num_cached_blocks.get(seq_id, 0):
                if block.block_hash != seq.block_hashes[i] or seq.num_computed_tokens < (i + 1) * bs:
                    raise AssertionError(f"sequence {seq_id} block {i} cached with a foreign or partial hash")
    for block in pool.blocks[1:]:
        if block.ref_cnt != refs.get(block.block_id, 0):
            raise AssertionError(
                f"{block}: ref count != table entries pointing at it ({refs.get(block.block_id, 0)})"
            )
    running = {s.seq_id for s in sched.running}
    if sched.num_seats_taken() > sched.max_running:
        raise AssertionError(f"{sched.num_seats_taken()} seats taken, max_num_seqs {sched.max_running}")
    for seq in sched.running:
        if seq.status != SeqStatus.RUNNING or sched.seqs.get(seq.seq_id) is not seq:
            raise AssertionError(f"running list holds {seq.status.name} sequence {seq.seq_id}")
        # Overlap: computed positions run at most into the pending samples (one per plan in
        # flight, plus the one being planned).
        # A speculative verify in flight adds its proposals' positions.
        if (
            not 0 <= seq.num_pending <= 8
            or seq.num_computed_tokens > seq.num_tokens + seq.num_pending + seq.spec_in_flight
            or (seq.spec_in_flight and seq.num_pending != 1)
        ):
            raise AssertionError(
                f"sequence {seq.seq_id}: {seq.num_computed_tokens} computed of {seq.num_tokens} known "
                f"+ {seq.num_pending} pending tokens + {seq.spec_in_flight} proposals"
            )
    for seq in sched.seqs.values():
        if (seq.status == SeqStatus.RUNNING) != (seq.seq_id in running):
            raise AssertionError(
                f"sequence {seq.seq_id} status {seq.status.name} disagrees with the running set"
            )
        if seq.status in (SeqStatus.WAITING, SeqStatus.PREEMPTED) and seq.seq_id in kv.tables:
            raise AssertionError(f"waiting sequence {seq.seq_id} still holds blocks")
    for req in sched.requests.values():
        if req.beam is not None:
            check_beam_group(req)
    num_waiting = sum(1 for s in sched.seqs.values() if s.status in (SeqStatus.WAITING, SeqStatus.PREEMPTED))
    if num_waiting != sched.num_waiting:
        raise AssertionError(f"num_waiting {sched.num_waiting} != waiting sequences {num_waiting}")


def check_released(kv, seq, table) -> None:
    """A sliding window's released entries: the null block, only a leading run, only with a
    window, and never one the sequence's next step reads (its first position's window)."""
    released = kv.num_released.get(seq.seq_id, 0)
    if not released:
        return
    if not kv.window:
        raise AssertionError(f"sequence {seq.seq_id}: {released} entries released without a sliding window")
    if any(block.block_id != NULL_BLOCK_ID for block in table[:released]):
        raise AssertionError(f"sequence {seq.seq_id}: a released entry still holds a block")
    next_start = seq.num_computed_tokens - seq.spec_in_flight  # (a verify may roll back to here)
    if released > kv.first_kept_block(next_start):
        raise AssertionError(
            f"sequence {seq.seq_id}: {released} blocks released, but position {next_start} still reads "
            f"block {kv.first_kept_block(next_start)}"
        )


def check_beam_group(req) -> None:
    """A beam request's live beams: at most beam_width, all running or all waiting (what
    keeps a coupled group from holding blocks while waiting for itself), equally long."""
    beams = req.sequences
    if len(beams) > req.sampling.beam_width:
        raise AssertionError(
            f"request {req.request_id}: {len(beams)} live beams, width {req.sampling.beam_width}"
        )
    running = {s.status == SeqStatus.RUNNING for s in beams}
    if len(running) > 1 or any(s.status == SeqStatus.FINISHED for s in beams):
        raise AssertionError(
            f"request {req.request_id}: beams {[s.status.name for s in beams]} (split group)"
        )
    if len({s.num_tokens for s in beams}) > 1:
        raise AssertionError(f"request {req.request_id}: beams of different lengths")


def check_plan(sched, plan: Plan) -> None:
    """Right after schedule(): every write target is exclusively owned (copy-on-write done),
    every scheduled sequence computes >= 1 token, tables cover the writes."""
    bs = sched.block_size
    dsts = {dst for _, dst in plan.copies}
    for item in (*plan.new, *plan.continuing):
        if not item.num_inputs:
            raise AssertionError(f"sequence {item.seq_id} scheduled with no token to compute")
        table = sched.kv.tables[item.seq_id]
        # A window: every entry before the step's first window is released, and the plan says so.
        released = sched.kv.num_released.get(item.seq_id, 0)
        sent = getattr(item, "num_released_blocks", None)
        if sent is None:
            sent = next((i for i, b in enumerate(item.block_ids) if b != NULL_BLOCK_ID), len(item.block_ids))
        if released != sched.kv.first_kept_block(item.start_pos) or sent != released:
            raise AssertionError(
                f"sequence {item.seq_id}: {released} entries released ({sent} in the plan), its step "
                f"from {item.start_pos} reads from block {sched.kv.first_kept_block(item.start_pos)}"
            )
        end = item.start_pos + item.num_inputs
        if len(table) * bs < end:
            raise AssertionError(
                f"sequence {item.seq_id}: table of {len(table)} blocks cannot hold {end} tokens"
            )
        for idx in range(item.start_pos // bs, (end - 1) // bs + 1):
            if table[idx].ref_cnt != 1:
                raise AssertionError(f"sequence {item.seq_id} writes into shared block {table[idx]} (no COW)")
            if table[idx].block_hash is not None:
                raise AssertionError(f"sequence {item.seq_id} writes into cached block {table[idx]} (no COW)")
    for src, dst in plan.copies:
        if sched.kv.pool.blocks[dst].ref_cnt != 1 or src == dst:
            raise AssertionError(f"copy {src}->{dst}: destination must be a fresh, exclusive block")
    if len(dsts) != len(plan.copies):
        raise AssertionError("two copies target the same block")


def check_all_free(sched) -> None:
    """After every request finished or was aborted: nothing leaked."""
    check_scheduler(sched)
    pool = sched.kv.pool
    if pool.num_free_blocks != pool.num_blocks - 1:
        raise AssertionError(f"leak: {pool.num_blocks - 1 - pool.num_free_blocks} blocks still held")
    if sched.kv.tables or sched.running or sched.num_waiting:
        raise AssertionError("sequences still live after every request ended")
