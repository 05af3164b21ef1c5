"""The physical KV block pool: metadata for every block, the free queue, the hash index.

Invariants (checked by `control_plane.invariants.check_pool`):
  - block 0 is the null block: never handed out, never cached, never in the free queue; a
    table entry a sliding window released holds it, and touch/free_blocks pass over it;
  - a block is in the free queue  <=>  its ref count is 0;
  - a block with a hash is in `cached` under that hash (and only full blocks get hashes);
  - the free queue is the eviction order: uncached free blocks sit at the front (reused
    first), cached free blocks behind them, least recently freed first.

Free queue as an intrusive doubly linked list (the links live on the blocks, with two
sentinels), so popping the front, appending, and removing a block from the middle -- a
prefix-cache hit reviving a free cached block -- are all O(1) with no allocation:

    head <-> [uncached] <-> [uncached] <-> [cached, freed earliest] <-> ... <-> tail
             ^ popleft() takes from here                      append() goes here ^
"""

from __future__ import annotations

from collections.abc import Iterable

from base.plan import NULL_BLOCK_ID


class KVBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None
        self.prev_free: KVBlock | None = None
        self.next_free: KVBlock | None = None

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:8] if self.block_hash else None
        return f"KVBlock(id={self.block_id}, ref={self.ref_cnt}, hash={h})"


class FreeBlockQueue:
    """Doubly linked list of free blocks with O(1) popleft/appendleft/append/remove."""

    __slots__ = ("_head", "_tail", "num_free_blocks")

    def __init__(self, blocks: Iterable[KVBlock]) -> None:
        self._head = KVBlock(-1)
        self._tail = KVBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVBlock:
        block = self._head.next_free
        if block is self._tail:
            raise ValueError("no free blocks left")
        self._unlink(block)
        return block

    def popleft_n(self, n: int) -> list[KVBlock]:
        if n > self.num_free_blocks:
            raise ValueError(f"asked for {n} free blocks, only {self.num_free_blocks} left")
        out = []
        block = self._head.next_free
        for _ in range(n):
            out.append(block)
            nxt = block.next_free
            block.prev_free = block.next_free = None
            block = nxt
        self._head.next_free = block
        block.prev_free = self._head
        self.num_free_blocks -= n
        return out

    def remove(self, block: KVBlock) -> None:
        if block.prev_free is None:
            raise AssertionError(f"{block} is not in the free queue")
        self._unlink(block)

    def append(self, block: KVBlock) -> None:
        last = self._tail.prev_free
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free_blocks += 1

    def appendleft(self, block: KVBlock) -> None:
        first = self._head.next_free
        first.prev_free = block
        block.next_free = first
        block.prev_free = self._head
        self._head.next_free = block
        self.num_free_blocks += 1

    def _unlink(self, block: KVBlock) -> None:
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def __iter__(self):
        block = self._head.next_free
        while block is not self._tail:
            yield block
            block = block.next_free


class BlockPool:
    """Owns every KVBlock. Callers (the KV cache manager) hold references and give them back."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError(f"a pool needs the null block plus at least one more, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[NULL_BLOCK_ID]
        self.free_queue = FreeBlockQueue(self.blocks[1:])
        self.cached: dict[bytes, KVBlock] = {}
        self.num_allocated_total = 0  # blocks handed out since start (a counter, for rates)
        self.num_evictions = 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now: uncached free + evictable cached free."""
        return self.free_queue.num_free_blocks

    def get_new_blocks(self, n: int) -> list[KVBlock]:
        """Take n blocks from the front of the free queue (evicting cached ones if needed)."""
        blocks = self.free_queue.popleft_n(n)
        for block in blocks:
            if block.block_hash is not None:
                self._evict(block)
            block.ref_cnt = 1
        self.num_allocated_total += n
        return blocks

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take one more reference on each block; a free cached block leaves the free queue."""
        null = self.null_block
        for block in blocks:
            if block is null:
                continue
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference each. Give blocks in eviction order: first evicted first.

        Uncached blocks go to the front (reused before anything cached); cached blocks to
        the back (LRU among cached).
        """
        null = self.null_block
        for block in blocks:
            if block is null:
                continue
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    self.free_queue.appendleft(block)
                else:
                    self.free_queue.append(block)
            elif block.ref_cnt < 0:
                raise AssertionError(f"double free of {block}")

    def get_cached_block(self, block_hash: bytes) -> KVBlock | None:
        return self.cached.get(block_hash)

    def cache_block(self, block: KVBlock, block_hash: bytes) -> None:
        """Register a full, computed block under its hash. A hash already cached keeps its
        first block (the duplicate stays uncached and is reused first when freed)."""
        if not self.enable_caching or block.block_hash is not None or block_hash in self.cached:
            return
        block.block_hash = block_hash
        self.cached[block_hash] = block

    def _evict(self, block: KVBlock) -> None:
        del self.cached[block.block_hash]
        block.block_hash = None
        self.num_evictions += 1

    def reset_prefix_cache(self) -> bool:
        """Forget every hash. Only allowed when no request holds a block (else False)."""
        if self.num_free_blocks != self.num_blocks - 1:
            return False
        for block in self.cached.values():
            block.block_hash = None
        self.cached.clear()
        # Rebuild the queue so every block is "uncached" in eviction order too.
        self.free_queue = FreeBlockQueue(self.blocks[1:])
        return True

    def usage(self) -> float:
        """Fraction of real blocks held by requests (free cached blocks count as free)."""
        return 1.0 - self.num_free_blocks / (self.num_blocks - 1)
