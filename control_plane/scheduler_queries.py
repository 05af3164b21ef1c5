"""The scheduler's read side and its recovery: block tables and stats for GetBlockTable /
GetStats, and what happens to every sequence when the worker is lost."""

from __future__ import annotations

from control_plane.speculation import SpeculationStats
from control_plane.stats import SequenceTable, StatsSnapshot, ref_count_histogram


class SchedulerQueries:
    """Mixin of `Scheduler`."""

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def has_pending_work(self) -> bool:
        return bool(self.requests) or bool(self.pending_finished)

    def block_tables(self, request_id: str) -> list[SequenceTable]:
        req = self._get(request_id)
        return [
            SequenceTable(
                s.sample_index,
                self.kv.block_ids(s.seq_id),
                s.num_tokens,
                min(
                    s.num_computed_tokens, s.num_tokens
                ),  # overlap: pending samples' slots are not tokens yet
            )
            for s in req.sequences
            if not s.is_finished
        ]

    def stats(self) -> StatsSnapshot:
        pool = self.kv.pool
        frag = sum(
            len(t) * self.block_size - min(self.seqs[sid].num_tokens, len(t) * self.block_size)
            for sid, t in self.kv.tables.items()
        )
        queries = self.kv.prefix_queries
        spec = self.speculator.stats if self.speculator is not None else SpeculationStats()
        return StatsSnapshot(
            num_blocks_total=pool.num_blocks - 1,
            num_blocks_free=pool.num_free_blocks,
            num_blocks_cached=len(pool.cached),
            kv_usage=pool.usage(),
            block_size=self.block_size,
            blocks_allocated_total=pool.num_allocated_total,
            blocks_allocated_per_s=self._alloc_rate.update(pool.num_allocated_total),
            prefix_cache_queries=queries,
            prefix_cache_hits=self.kv.prefix_hits,
            prefix_cache_hit_rate=self.kv.prefix_hits / queries if queries else 0.0,
            internal_fragmentation_slots=frag,
            ref_count_histogram=ref_count_histogram(pool.blocks),
            num_preemptions=self.num_preemptions,
            num_running=len(self.running),
            num_waiting=self.num_waiting,
            num_finished_requests=self.num_finished_requests,
            num_steps=self.num_steps,
            num_evictions=pool.num_evictions,
            spec_num_verifies=spec.num_verifies,
            spec_num_proposed=spec.num_proposed,
            spec_num_accepted=spec.num_accepted,
            spec_acceptance_per_position=spec.acceptance_per_position(),
        )

    def on_worker_lost(self) -> None:
        """The worker's mirrors and KV contents are gone (restart) or unknown (failed step):
        preempt every running sequence, forget what the worker was told, and drop the prefix
        cache, whose blocks lived in the lost KV pool."""
        for seq in reversed(self.running):
            self._preempt(seq)
        self.running.clear()
        self.pending_finished.clear()
        for seq in self.seqs.values():
            seq.num_pending = 0  # samples of the lost steps never arrive; recompute redraws them
            seq.spec_in_flight = 0  # (nor do verifies)
        for req in self.requests.values():
            req.fan_out_planned = req.forked  # a fan-out lost with its step is planned again
        if not self.kv.pool.reset_prefix_cache():
            raise AssertionError("blocks still held after preempting every running sequence")

    def reset_prefix_cache(self) -> bool:
        return self.kv.pool.reset_prefix_cache()
