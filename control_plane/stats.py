"""A point-in-time snapshot of the control plane's memory and scheduling state."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field


@dataclass(slots=True)
class SequenceTable:
    """One live sequence's block table, for `GetBlockTable` (proof that paging is on)."""

    index: int  # sample index within the request
    block_ids: list[int]
    num_tokens: int  # tokens in the sequence (prompt + generated)
    num_computed_tokens: int  # of which K/V are in the cache


@dataclass(slots=True)
class StatsSnapshot:
    num_blocks_total: int  # real blocks (the null block excluded)
    num_blocks_free: int  # free now, including evictable cached blocks
    num_blocks_cached: int  # blocks holding a prefix-cache hash (in use or free)
    kv_usage: float  # fraction of real blocks held by sequences, 0..1
    block_size: int
    blocks_allocated_total: int
    blocks_allocated_per_s: float  # since the previous snapshot
    prefix_cache_queries: int  # prompt tokens looked up
    prefix_cache_hits: int  # of which were cached
    prefix_cache_hit_rate: float
    internal_fragmentation_slots: int  # allocated slots - used slots over live tables
    ref_count_histogram: dict[int, int] = field(default_factory=dict)  # ref count -> blocks
    num_preemptions: int = 0
    num_running: int = 0
    num_waiting: int = 0
    num_finished_requests: int = 0
    num_steps: int = 0
    num_evictions: int = 0
    # Speculative decoding (control_plane/speculation.py SpeculationStats): counters since start.
    spec_num_verifies: int = 0
    spec_num_proposed: int = 0
    spec_num_accepted: int = 0
    spec_acceptance_per_position: list[float] = field(default_factory=list)  # position i: rate

    @property
    def spec_acceptance_rate(self) -> float:
        return self.spec_num_accepted / self.spec_num_proposed if self.spec_num_proposed else 0.0

    @property
    def spec_mean_accepted_length(self) -> float:
        """Accepted proposals per verify step (tokens per step is this + 1)."""
        return self.spec_num_accepted / self.spec_num_verifies if self.spec_num_verifies else 0.0


class AllocationRate:
    """Blocks handed out per second between two snapshots."""

    __slots__ = ("_last_t", "_last_n")

    def __init__(self) -> None:
        self._last_t = time.monotonic()
        self._last_n = 0

    def update(self, total: int) -> float:
        now = time.monotonic()
        dt = now - self._last_t
        rate = (total - self._last_n) / dt if dt > 0 else 0.0
        self._last_t, self._last_n = now, total
        return rate


def ref_count_histogram(blocks) -> dict[int, int]:
    return dict(sorted(Counter(b.ref_cnt for b in blocks[1:] if b.ref_cnt > 0).items()))
