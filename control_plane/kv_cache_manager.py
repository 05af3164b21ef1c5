"""Per-sequence block tables over the shared block pool: allocation, prefix hits, fork,
copy-on-write, and freeing.

One block table per sequence, shared by every layer (block id b is slot range
[b*block_size, (b+1)*block_size) in *each* layer's K and V pool).

    positions:  0 ........ 15 | 16 ....... 31 | 32 .. 34 (35 tokens, block size 16)
    table:      [ block 7      | block 3       | block 12 (3 of 16 slots used) ]

Sliding window (`window` > 0: the model windows every layer, ModelFacts.sliding_window): a
step computing positions from `start` on reads keys from start - window + 1 on, so table
entries wholly before that are released -- the block is freed (still cached if full and
hashed) and the entry becomes the null block, which keeps indices = positions // block_size:

    window 20, a step from position 53 reads 34..53:
    table:      [ null          | null          | block 12 (32..47) | block 4 (48..53) ]

Invariants (see control_plane.invariants):
  - sum of ref counts == number of table entries pointing at real blocks;
  - a sequence's table holds the null block only in its first `num_released` entries, which
    lie wholly before the window of the sequence's next position;
  - a write into a block with ref count > 1, or into a cached block, is preceded by a
    copy-on-write in the same step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from control_plane.block_hash import extend_block_hashes
from control_plane.block_pool import BlockPool, KVBlock
from control_plane.request import Sequence


@dataclass(slots=True)
class Allocation:
    """What `allocate_slots` changed in one sequence's table (the plan's diff source)."""

    num_new_blocks: int = 0  # appended to the end of the table
    replaced: list[tuple[int, int]] = field(default_factory=list)  # (index, new block id)
    copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) block ids


_NO_CHANGE = Allocation()


class KVCacheManager:
    def __init__(
        self, num_blocks: int, block_size: int, enable_caching: bool = True, window: int = 0
    ) -> None:
        if block_size < 1 or block_size & (block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {block_size}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.window = window  # every layer's sliding window; 0 = some layer sees all (keep every block)
        self.tables: dict[int, list[KVBlock]] = {}
        self.num_released: dict[int, int] = {}  # sliding window: leading table entries released
        self.num_cached_blocks: dict[int, int] = {}  # table prefix already hashed + cached
        # The plan being made: sequences whose scheduled tokens fill blocks, and the hashes of
        # those full blocks (not cached yet). See begin_plan / prefix_being_filled.
        self._filling_seqs: list[Sequence] = []
        self._filling_hashes: set = set()
        self.prefix_queries = 0  # prompt tokens looked up
        self.prefix_hits = 0  # of which found cached

    # -- prefix cache -------------------------------------------------------------------
    def _hash_blocks(self, seq: Sequence, num_full: int) -> None:
        """The block hashes of `seq`'s first `num_full` blocks (those not hashed yet are added)."""
        req = seq.request
        extend_block_hashes(
            seq.block_hashes, seq.token_ids, self.block_size, num_full, req.extra_keys, req.images
        )

    def get_computed_blocks(self, seq: Sequence) -> tuple[list[KVBlock], int]:
        """Longest cached prefix of `seq`, in whole blocks, leaving >= 1 token to compute.

        Returns the blocks (not yet referenced: pass them to `allocate_slots`) and the
        number of tokens they cover. Changes no state. A request that asks for prompt logprobs
        gets no hits: every prompt position must be computed to have logits (vLLM does the same).
        """
        if not self.enable_caching or seq.request.sampling.prompt_logprobs is not None:
            return [], 0
        bs = self.block_size
        max_blocks = (seq.num_tokens - 1) // bs  # cap: the last token is always computed
        self._hash_blocks(seq, max_blocks)
        if self.window:
            return self._windowed_hits(seq.block_hashes[:max_blocks])
        hits: list[KVBlock] = []
        get = self.pool.cached.get
        for block_hash in seq.block_hashes[:max_blocks]:
            block = get(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * bs

    def _windowed_hits(self, hashes: list) -> tuple[list[KVBlock], int]:
        """A sliding-window model's longest prefix hit: m blocks whose last ones -- those inside
        the window of position m * block_size, where computing resumes -- are all cached; the
        earlier ones may have been evicted (the null block stands in for them). Valid because a
        block's hash chains every token before it: the cached KV is what this prefix computes."""
        cached, bs = self.pool.cached, self.block_size
        best = run_start = 0  # run_start: first block of the current run of cached blocks
        for i, block_hash in enumerate(hashes):
            if block_hash not in cached:
                run_start = i + 1
            elif run_start <= self.first_kept_block((i + 1) * bs):
                best = i + 1
        first = self.first_kept_block(best * bs)
        hits = [self.pool.null_block] * first + [cached[h] for h in hashes[first:best]]
        return hits, best * bs

    def first_kept_block(self, start: int) -> int:
        """Table index of the first block a step computing positions from `start` on reads
        (every earlier one can be released); 0 without a window."""
        return max(start - self.window + 1, 0) // self.block_size if self.window else 0

    # -- prefixes filled by the plan being made ------------------------------------------
    # Requests that share a prompt and arrive together would otherwise each compute it in the
    # first plan (a block's content is only cacheable once some plan fills it). Instead, a
    # waiting request whose next uncached block this plan fills waits one plan and then hits it.
    def begin_plan(self) -> None:
        """Cache the full blocks the previous plan fills: it has been handed to the worker,
        which runs plans in order, so every later plan may read them (a failed step drops the
        whole cache, see Scheduler.on_worker_lost). Then start tracking this plan."""
        for seq in self._filling_seqs:
            if seq.seq_id in self.tables:
                self.cache_full_blocks(seq)
        self._filling_seqs.clear()
        self._filling_hashes.clear()

    def note_scheduled(self, seq: Sequence) -> None:
        """`seq`'s tokens up to num_computed_tokens are computed by the plan being made."""
        if not self.enable_caching:
            return
        num_full = min(seq.num_computed_tokens, seq.num_tokens) // self.block_size
        done = self.num_cached_blocks.get(seq.seq_id, 0)
        if num_full > done:
            self._hash_blocks(seq, num_full)
            self._filling_hashes.update(seq.block_hashes[done:num_full])
            self._filling_seqs.append(seq)

    def prefix_being_filled(self, seq: Sequence, num_hit_blocks: int) -> bool:
        """Whether the block after `seq`'s cached prefix is one the plan being made fills for
        another sequence (call after get_computed_blocks, which hashed the prompt)."""
        if seq.request.sampling.prompt_logprobs is not None:
            return False  # it will not read the cache anyway
        hashes = seq.block_hashes
        return num_hit_blocks < len(hashes) and hashes[num_hit_blocks] in self._filling_hashes

    def record_prefix_lookup(self, num_tokens: int, num_hit: int) -> None:
        """Count a lookup once, when the sequence is admitted (not on every blocked retry)."""
        self.prefix_queries += num_tokens
        self.prefix_hits += num_hit

    # -- allocation ---------------------------------------------------------------------
    def allocate_slots(
        self, seq: Sequence, num_new_tokens: int, computed_blocks: list[KVBlock] | None = None
    ) -> Allocation | None:
        """Make room for `num_new_tokens` tokens starting at `seq.num_computed_tokens`
        (plus `computed_blocks`, prefix hits on first admission). Allocates on demand:
        a new block only when the last one is full. Copies-on-write any shared block the new
        tokens write into. Returns None, changing nothing else, when the pool cannot satisfy it.
        A sliding window's entries before `start`'s window are released first, whatever the
        outcome (nothing reads them again; a preempted sequence recomputes).
        """
        bs = self.block_size
        table = self.tables.get(seq.seq_id)
        if table is None:
            table = []
        start = seq.num_computed_tokens + (len(computed_blocks) * bs if computed_blocks else 0)
        if self.window and table:
            self._release_before(seq, table, start)
        end = start + num_new_tokens
        num_needed = -(-end // bs) - len(table) - (len(computed_blocks) if computed_blocks else 0)
        first_write = start // bs
        # Fast path: a decode step inside an unshared, uncached block.
        if (
            num_needed <= 0
            and not computed_blocks
            and (first_write >= len(table) or _writable(table[first_write]))
        ):
            return _NO_CHANGE
        cow = [i for i in range(first_write, min(-(-end // bs), len(table))) if not _writable(table[i])]
        null = self.pool.null_block
        num_revived = (
            sum(1 for b in computed_blocks if b.ref_cnt == 0 and b is not null) if computed_blocks else 0
        )
        if max(num_needed, 0) + len(cow) > self.pool.num_free_blocks - num_revived:
            return None
        alloc = Allocation()
        if seq.seq_id not in self.tables:
            self.tables[seq.seq_id] = table
            self.num_cached_blocks[seq.seq_id] = 0
        if computed_blocks:
            self.pool.touch(computed_blocks)
            table.extend(computed_blocks)
            alloc.num_new_blocks += len(computed_blocks)
            self.num_cached_blocks[seq.seq_id] = len(table)
            if computed_blocks[0] is null:  # a windowed hit (_windowed_hits)
                self.num_released[seq.seq_id] = self.first_kept_block(start)
        for i in cow:
            src = table[i]
            (dst,) = self.pool.get_new_blocks(1)
            self.pool.free_blocks((src,))  # ref > 1, so it never reaches the free queue here
            table[i] = dst
            alloc.replaced.append((i, dst.block_id))
            alloc.copies.append((src.block_id, dst.block_id))
        if num_needed > 0:
            table.extend(self.pool.get_new_blocks(num_needed))
            alloc.num_new_blocks += num_needed
        return alloc

    def release_before_window(self, seq: Sequence) -> None:
        """Release what `seq`'s next step (from num_computed_tokens on) no longer reads, ahead of
        allocate_slots (which does it too): a group's count then sees the blocks its members free."""
        table = self.tables.get(seq.seq_id)
        if self.window and table:
            self._release_before(seq, table, seq.num_computed_tokens)

    def _release_before(self, seq: Sequence, table: list[KVBlock], start: int) -> None:
        """Release the entries wholly before `start`'s window (full known blocks are cached
        first, so they stay evictable prefix hits)."""
        first = min(self.first_kept_block(start), len(table))
        done = self.num_released.get(seq.seq_id, 0)
        if first <= done:
            return
        self.cache_full_blocks(seq)
        released = table[done:first]
        table[done:first] = [self.pool.null_block] * (first - done)
        self.pool.free_blocks(released)  # earliest first: evicted first
        self.num_released[seq.seq_id] = first

    def num_blocks_held(self, seq_id: int) -> int:
        """Real blocks in the sequence's table (released entries do not count)."""
        return len(self.tables.get(seq_id, ())) - self.num_released.get(seq_id, 0)

    def max_blocks_held(self, num_tokens: int, max_chunk: int) -> int:
        """The most blocks a sequence of `num_tokens` tokens holds at once when no step computes
        more than `max_chunk` of them: all of them, or with a window the ones a chunk writes
        plus the ones its first position still reads."""
        full = self.num_blocks_needed(num_tokens)
        if not self.window:
            return full
        return min(full, self.num_blocks_needed(self.window - 1 + max_chunk) + 1)

    def num_blocks_to_allocate(self, work: list[tuple[Sequence, int]]) -> int:
        """Free blocks that `allocate_slots(seq, n)` for every (seq, n) in `work`, in any
        order, takes: new blocks past each table's end plus copies-on-write (a window's releases
        are not credited: call release_before_window first). A shared block
        that w of them write into copies w times, or w - 1 when they are all its holders (the
        last writer then owns it)."""
        bs = self.block_size
        total = 0
        writers: dict[int, list] = {}
        for seq, n in work:
            table = self.tables.get(seq.seq_id, ())
            start = seq.num_computed_tokens
            end_block = -(-(start + n) // bs)
            total += max(end_block - len(table), 0)
            for i in range(start // bs, min(end_block, len(table))):
                block = table[i]
                if not _writable(block):
                    writers.setdefault(block.block_id, [block, 0])[1] += 1
        for block, w in writers.values():
            total += w if w < block.ref_cnt or block.block_hash is not None else w - 1
        return total

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Hash and cache every block whose slots are all computed (call after a step ran)."""
        if not self.enable_caching:
            return
        # Capped by the known tokens: a pending sample's slot is computed but its id unknown.
        num_full = min(seq.num_computed_tokens, seq.num_tokens) // self.block_size
        done = self.num_cached_blocks.get(seq.seq_id, 0)
        if num_full <= done:
            return
        self._hash_blocks(seq, num_full)
        table = self.tables[seq.seq_id]
        null = self.pool.null_block
        for i in range(done, num_full):
            if table[i] is not null:  # (a window released it before its last token was known)
                self.pool.cache_block(table[i], seq.block_hashes[i])
        self.num_cached_blocks[seq.seq_id] = num_full

    def truncate(self, seq: Sequence, num_tokens: int) -> int:
        """Speculation's rollback: keep the blocks holding the first `num_tokens` slots; the
        ones after, which only rejected proposals reached, are freed now (tail first). Returns
        the table's new length. Never cuts a cached block: caching stops at the known tokens."""
        table = self.tables[seq.seq_id]
        keep = self.num_blocks_needed(num_tokens)
        if len(table) > keep:
            if self.num_cached_blocks.get(seq.seq_id, 0) > keep:
                raise AssertionError(f"sequence {seq.seq_id}: rollback below its cached blocks")
            dropped = table[keep:]
            del table[keep:]
            self.pool.free_blocks(reversed(dropped))
        return len(table)

    def fork(self, parent: Sequence, child: Sequence, num_tokens: int) -> bool:
        """Share the blocks holding parent's first `num_tokens` tokens with child (ref count
        += 1). Writes into them are copy-on-write. False, changing nothing, when the child
        cannot start at `num_tokens`: a window (overlap ran the parent ahead) released a block
        the child still reads and the prefix cache no longer has it -- the child recomputes."""
        if child.seq_id in self.tables:
            raise ValueError(f"sequence {child.seq_id} already has a block table")
        table = self.tables[parent.seq_id][: self.num_blocks_needed(num_tokens)]
        released = min(self.num_released.get(parent.seq_id, 0), len(table))
        needed = min(self.first_kept_block(num_tokens), released)
        if needed < released:  # take back from the cache what the parent released too early
            back = [self.pool.cached.get(h) for h in parent.block_hashes[needed:released]]
            if len(back) < released - needed or None in back:
                return False
            table[needed:released] = back
            released = needed
        self.pool.touch(table)
        self.tables[child.seq_id] = table
        if released:
            self.num_released[child.seq_id] = released
        # Only blocks full within the child's tokens are its cached prefix: the parent may have
        # filled (and cached) the last shared block with a token the child does not have.
        self.num_cached_blocks[child.seq_id] = min(
            self.num_cached_blocks[parent.seq_id], num_tokens // self.block_size
        )
        return True

    def free(self, seq: Sequence) -> None:
        """Release the sequence's blocks, tail first, so a shared prefix survives longest."""
        table = self.tables.pop(seq.seq_id, None)
        self.num_cached_blocks.pop(seq.seq_id, None)
        self.num_released.pop(seq.seq_id, None)
        if table:
            self.pool.free_blocks(reversed(table))

    def block_ids(self, seq_id: int) -> list[int]:
        return [b.block_id for b in self.tables.get(seq_id, ())]

    def num_blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)


def _writable(block: KVBlock) -> bool:
    """A step may write into the block in place: nobody else holds it and it is not in the
    prefix cache. A cached block a sequence writes into holds another sequence's content
    (n > 1 with overlap: the parent's planned-ahead token filled the prompt's last block, which
    was cached under the parent's tokens before the child, its last holder, wrote its own):
    writing in place would leave a cache entry whose K/V no longer match its hash."""
    return block.ref_cnt == 1 and block.block_hash is None
