"""CUDA graphs for the decode forward: one captured graph per batch-size bucket.

A decode step launches a few kernels per layer; at small batch the CPU cost of launching
them dominates. A graph replays the whole forward with one launch. Replays see the
addresses recorded at capture time, so everything that changes per step lives in static
device buffers that the kernels read:

    static buffers (sized for the largest bucket)        filled each step BEFORE replay
    ---------------------------------------------        ------------------------------
    input_ids, positions, slot_mapping   int64 [B]       host (pinned) -> device copies on
    seq_lens                              int32 [B]       the current stream, outside the
    block_tables                          int32 [B, W]    graph; W = ceil(max_model_len / bs)
    query_start_loc                       int32 [B + 1]   constant 0..B (one token per row)

`positions` are rotary positions: the KV position plus, for a vision-language model's sequence,
its M-RoPE shift (a decode token is text, so its three rotary axes are equal and one position
per row suffices); slots come from the KV position.

Why this is safe across steps (the failure mode to avoid: a block that was never synced):
  - the full table row of every sequence is rewritten before each replay, so a block
    appended this step is visible to the kernels of this step;
  - no per-step value is a kernel argument: the attention backend plans its launch from
    (rows, max_seq_len) and the graph passes max_model_len, the buffers' capacity, so grid
    and shared memory are fixed; CTAs past a row's real context exit early;
  - padding rows (bucket > batch) use slot -1 (no KV write) and seq_len 0 (no keys), so they
    never touch real blocks.

Graphs are captured lazily, the first time a bucket is used, with all-padding inputs (nothing
is written to the KV pool), after two eager warm-up runs that compile and load the kernels.
`invalidate` drops them (worker reset). All graphs share one memory pool: they never run
concurrently, and each one's output tensor stays alive, so no replay overwrites another's.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from worker.batch import AttentionMetadata, ScheduledSequence, blocks_needed, fill_decode_inputs
from worker.kv_cache import KVCache

WARMUP_RUNS = 2


def bucket_sizes(max_batch: int) -> tuple[int, ...]:
    """Powers of two below `max_batch`, then `max_batch` itself: 1, 2, 4, ..., max_batch."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    sizes = []
    size = 1
    while size < max_batch:
        sizes.append(size)
        size *= 2
    sizes.append(max_batch)
    return tuple(sizes)


def bucket_for(num_seqs: int, buckets: Sequence[int]) -> int | None:
    """The smallest bucket that holds `num_seqs` rows; None when the batch is too large."""
    for size in buckets:
        if size >= num_seqs:
            return size
    return None


class StaticDecodeInputs:
    """Pinned host staging arrays and the device buffers the captured kernels read."""

    def __init__(self, max_batch: int, table_width: int, device: torch.device) -> None:
        def pair(shape, dtype):
            return torch.zeros(shape, dtype=dtype, pin_memory=True), torch.zeros(
                shape, dtype=dtype, device=device
            )

        self.host_ids, self.input_ids = pair(max_batch, torch.int64)
        self.host_positions, self.positions = pair(max_batch, torch.int64)
        self.host_slots, self.slot_mapping = pair(max_batch, torch.int64)
        self.host_lens, self.seq_lens = pair(max_batch, torch.int32)
        self.host_tables, self.block_tables = pair((max_batch, table_width), torch.int32)
        self.query_start_loc = torch.arange(max_batch + 1, dtype=torch.int32, device=device)
        self.slot_mapping.fill_(-1)
        self._copied = torch.cuda.Event()
        self._copied.record()

    def fill(self, seqs: Sequence[ScheduledSequence], bucket: int, block_size: int) -> None:
        """Stage this step's rows (padded to `bucket`) and copy them to the device buffers on
        the current stream, so the replay that follows on that stream sees them."""
        self._copied.synchronize()  # the previous step's copies have read the staging arrays
        fill_decode_inputs(
            seqs,
            block_size,
            self.host_ids[:bucket].numpy(),
            self.host_positions[:bucket].numpy(),
            self.host_slots[:bucket].numpy(),
            self.host_lens[:bucket].numpy(),
            self.host_tables[:bucket].numpy(),
        )
        for host, device in (
            (self.host_ids, self.input_ids),
            (self.host_positions, self.positions),
            (self.host_slots, self.slot_mapping),
            (self.host_lens, self.seq_lens),
            (self.host_tables, self.block_tables),
        ):
            device[:bucket].copy_(host[:bucket], non_blocking=True)
        self._copied.record()

    def pad(self, bucket: int) -> None:
        """All rows padding (capture inputs): nothing is written, nothing is attended."""
        self.fill([], bucket, block_size=1)

    def metadata(self, bucket: int, max_model_len: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bucket],
            block_tables=self.block_tables[:bucket],
            seq_lens=self.seq_lens[:bucket],
            query_start_loc=self.query_start_loc[: bucket + 1],
            max_query_len=1,
            max_seq_len=max_model_len,  # the capacity, not this step's length: see module doc
            num_decode_seqs=bucket,
            host_seq_lens=None,  # a replay's lengths differ from the capture's
        )


class DecodeGraphRunner:
    """Runs decode-only steps of up to `max_batch` sequences through captured graphs."""

    def __init__(
        self, model: nn.Module, kv_cache: KVCache, max_model_len: int, max_batch: int, device: torch.device
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.max_model_len = max_model_len
        self.block_size = kv_cache.addressing_block_size
        self.device = device
        self.buckets = bucket_sizes(max_batch)
        self.static = StaticDecodeInputs(max_batch, blocks_needed(max_model_len, self.block_size), device)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, Tensor]] = {}
        self._pool = None

    def accepts(self, seqs: Sequence[ScheduledSequence]) -> bool:
        """A pure decode step (one token per sequence) that fits the largest bucket."""
        return 0 < len(seqs) <= self.buckets[-1] and all(len(s.token_ids) == 1 for s in seqs)

    def forward(self, seqs: Sequence[ScheduledSequence]) -> Tensor:
        """Final hidden states [number of sampling sequences, hidden] of a decode step."""
        bucket = bucket_for(len(seqs), self.buckets)
        if bucket is None or not self.accepts(seqs):
            raise ValueError("DecodeGraphRunner.forward needs a decode batch that accepts() took")
        graph, hidden = self._graphs.get(bucket) or self._capture(bucket)
        self.static.fill(seqs, bucket, self.block_size)
        graph.replay()
        sampling_rows = [row for row, seq in enumerate(seqs) if seq.sample]
        if len(sampling_rows) == len(seqs):
            return hidden[: len(seqs)]
        return hidden[torch.tensor(sampling_rows, dtype=torch.int64, device=self.device)]

    def capture_all(self) -> None:
        """Capture every bucket now (start time: memory profile, self-check) instead of at
        each bucket's first use."""
        for bucket in self.buckets:
            if bucket not in self._graphs:
                self._capture(bucket)

    @property
    def num_captured(self) -> int:
        return len(self._graphs)

    def invalidate(self) -> None:
        """Forget every graph (and its memory pool); the next decode step captures anew."""
        self._graphs.clear()
        self._pool = None

    def _run(self, bucket: int) -> Tensor:
        s = self.static
        meta = s.metadata(bucket, self.max_model_len)
        return self.model(s.input_ids[:bucket], s.positions[:bucket], self.kv_cache, meta)

    def _capture(self, bucket: int) -> tuple[torch.cuda.CUDAGraph, Tensor]:
        self.static.pad(bucket)
        current = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            for _ in range(WARMUP_RUNS):
                self._run(bucket)
        current.wait_stream(side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        # thread_local: a capture on the step thread must not turn another thread's unrelated
        # CUDA call (e.g. the gRPC side's) into a capture error, nor be broken by it.
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            hidden = self._run(bucket)
        self._graphs[bucket] = (graph, hidden)
        return graph, hidden
