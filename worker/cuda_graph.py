"""CUDA graphs for the decode forward: one captured graph per (batch bucket, context bucket).

A decode step launches a few kernels per layer; at small batch the CPU cost of launching
them dominates. A graph replays the whole forward with one launch. Replays see the
addresses recorded at capture time, so everything that changes per step lives in static
device buffers that the kernels read:

    static buffers (sized for the largest bucket)        filled each step BEFORE replay
    ---------------------------------------------        ------------------------------
    input_ids, positions, slot_mapping   int64 [B]       host (pinned) -> device copies on
    seq_lens                              int32 [B]       the current stream, outside the
    table_rows                            int64 [B]       graph (O(batch) host work)
    block_tables                          int32 [B, W]    gathered ON THE DEVICE from the
                                                          persistent table: index_select(
                                                          table, 0, table_rows); W = ceil(
                                                          max_model_len / bs)
    query_start_loc                       int32 [B + 1]   constant 0..B (one token per row)

The persistent device table (worker/block_table.py) receives only the entries plans changed;
the gather is one O(B * W) device copy (2 MiB at batch 64 and 131k context: ~microseconds).
It runs outside the graph because the persistent table is reallocated when it grows.

`positions` are rotary positions: the KV position plus, for a vision-language model's sequence,
its M-RoPE shift (a decode token is text, so its three rotary axes are equal and one position
per row suffices); slots come from the KV position.

Why this is safe across steps (the failure mode to avoid: a block that was never synced):
  - every row's table is gathered from the synced persistent table before each replay, so a
    block appended this step is visible to the kernels of this step;
  - no per-step value is a kernel argument: the attention backend plans its launch from
    (rows, max_seq_len), and a graph is captured per context bucket with max_seq_len = the
    bucket (powers of two from MIN_CONTEXT_BUCKET up to max_model_len), so a replay uses the
    split-K partitions an eager launch at the bucket's length would; a step replays the graph
    of the smallest context bucket >= its longest row, and CTAs past a row's real context exit;
  - padding rows (bucket > batch) use slot -1 (no KV write), seq_len 0 (no keys) and the
    null row, so they never touch real blocks.

Graphs are captured lazily, the first time a (batch, context) bucket is used, with all-padding
inputs (nothing is written to the KV pool), after two eager warm-up runs that compile and load
the kernels. At most len(batch buckets) * len(context buckets) graphs exist (`max_graphs`).
`invalidate` drops them (worker reset). All graphs share one memory pool: they never run
concurrently, so their activations and split-K workspaces reuse the same memory (the pool
holds about the largest graph's); what each graph keeps is its output [bucket, hidden].
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from worker.batch import AttentionMetadata, ScheduledSequence, blocks_needed, fill_decode_inputs
from worker.block_table import NULL_ROW, BlockTable
from worker.kv_cache import KVCache

WARMUP_RUNS = 2
# Contexts up to this share one graph: below it the planner's partitions barely matter
# (PARTITION_CHOICES start at 128 tokens), and each bucket is another capture.
MIN_CONTEXT_BUCKET = 512


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


def context_buckets(max_model_len: int) -> tuple[int, ...]:
    """MIN_CONTEXT_BUCKET, doubling, below max_model_len, then max_model_len itself."""
    return tuple(size for size in bucket_sizes(max_model_len) if size >= MIN_CONTEXT_BUCKET) or (
        max_model_len,
    )


def capture_plan(max_batch: int, max_model_len: int) -> tuple[tuple[int, int], ...]:
    """The (batch bucket, context bucket) graphs `DecodeGraphRunner.capture_all` captures, in
    its order: every batch bucket, smallest first, at the capacity context. The only order a
    start-up capture happens in (the memory profile's runner, then the serving runner, each
    runs it once), so a tensor-parallel group whose ranks agree on it captures the same
    collectives in the same order on every rank (worker/tp/cuda_rank.py checks they agree).
    Later captures happen when a plan first needs a bucket: the same plan on every rank."""
    context = bucket_for(max_model_len, context_buckets(max_model_len))
    return tuple((bucket, context) for bucket in bucket_sizes(max_batch))


def graph_key(
    seqs: Sequence[ScheduledSequence], buckets: Sequence[int], contexts: Sequence[int]
) -> tuple[int, int] | None:
    """(batch bucket, context bucket) of a decode step: the smallest of each that holds it."""
    bucket = bucket_for(len(seqs), buckets)
    context = bucket_for(max(s.seq_len for s in seqs), contexts)
    return None if bucket is None or context is None else (bucket, context)


def bucket_for(num_seqs: int, buckets: Sequence[int]) -> int | None:
    """The smallest bucket that holds `num_seqs` rows; None when the batch is too large."""
    for size in buckets:
        if size >= num_seqs:
            return size
    return None


class StaticDecodeInputs:
    """Host staging arrays (pinned on CUDA) and the device buffers the captured kernels read.
    On a CPU device the same code runs without pinning or events (tests emulate the uploads)."""

    def __init__(self, max_batch: int, table_width: int, device: torch.device) -> None:
        cuda = torch.device(device).type == "cuda"

        def pair(shape, dtype):
            return torch.zeros(shape, dtype=dtype, pin_memory=cuda), torch.zeros(
                shape, dtype=dtype, device=device
            )

        self.host_ids, self.input_ids = pair(max_batch, torch.int64)
        self.host_positions, self.positions = pair(max_batch, torch.int64)
        self.host_slots, self.slot_mapping = pair(max_batch, torch.int64)
        self.host_lens, self.seq_lens = pair(max_batch, torch.int32)
        self.host_rows, self.table_rows = pair(max_batch, torch.int64)
        self.block_tables = torch.zeros((max_batch, table_width), dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(max_batch + 1, dtype=torch.int32, device=device)
        self.slot_mapping.fill_(-1)
        self._copied = torch.cuda.Event() if cuda else None
        if cuda:
            self._copied.record()

    def fill(
        self, seqs: Sequence[ScheduledSequence], bucket: int, block_size: int, table: BlockTable
    ) -> None:
        """Stage this step's rows (padded to `bucket`), copy them to the device buffers and
        gather their tables from the synced persistent table, all on the current stream, so
        the replay that follows on that stream sees them."""
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copies have read the staging arrays
        device_table = table.sync()
        fill_decode_inputs(
            seqs,
            block_size,
            table.host,
            self.host_ids[:bucket].numpy(),
            self.host_positions[:bucket].numpy(),
            self.host_slots[:bucket].numpy(),
            self.host_lens[:bucket].numpy(),
            self.host_rows[:bucket].numpy(),
        )
        for host, device in (
            (self.host_ids, self.input_ids),
            (self.host_positions, self.positions),
            (self.host_slots, self.slot_mapping),
            (self.host_lens, self.seq_lens),
            (self.host_rows, self.table_rows),
        ):
            device[:bucket].copy_(host[:bucket], non_blocking=True)
        torch.index_select(device_table, 0, self.table_rows[:bucket], out=self.block_tables[:bucket])
        if self._copied is not None:
            self._copied.record()

    def pad(self, bucket: int) -> None:
        """All rows padding (capture inputs): nothing is written, nothing is attended."""
        self.input_ids[:bucket].zero_()
        self.positions[:bucket].zero_()
        self.slot_mapping[:bucket].fill_(-1)
        self.seq_lens[:bucket].zero_()
        self.table_rows[:bucket].fill_(NULL_ROW)
        self.block_tables[:bucket].zero_()

    def metadata(self, bucket: int, context: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bucket],
            block_tables=self.block_tables[:bucket],
            seq_lens=self.seq_lens[:bucket],
            query_start_loc=self.query_start_loc[: bucket + 1],
            max_query_len=1,
            max_seq_len=context,  # the context bucket, not this step's length: see module doc
            num_decode_seqs=bucket,
            host_seq_lens=None,  # a replay's lengths differ from the capture's
        )


class DecodeGraphRunner:
    """Runs decode-only steps of up to `max_batch` sequences through captured graphs."""

    def __init__(
        self,
        model: nn.Module,
        kv_cache: KVCache,
        max_model_len: int,
        max_batch: int,
        device: torch.device,
        table: BlockTable | None = None,
    ) -> None:
        """`table`: the worker's persistent block table (its sequences' rows); a runner
        without one can capture (e.g. to measure memory) but not run steps."""
        self.model = model
        self.kv_cache = kv_cache
        self.max_model_len = max_model_len
        self.block_size = kv_cache.addressing_block_size
        self.device = device
        self.buckets = bucket_sizes(max_batch)
        self.context_buckets = context_buckets(max_model_len)
        self.table = table
        self.static = StaticDecodeInputs(max_batch, blocks_needed(max_model_len, self.block_size), device)
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, Tensor]] = {}
        self._pool = None
        # One warm-up stream for every capture: torch gives each stream that runs a GEMM its
        # own cuBLAS workspace (32 MiB on sm_90) for the rest of the process, and a new stream
        # per capture walked its pool of 32. Suspected cause of the ~0.5 GiB each CUDA worker
        # left behind on the H200 (docs/GPU_VALIDATION.md).
        self._warmup_stream: torch.cuda.Stream | None = None
        self.num_replays = 0  # decode steps served by a replay (tests check the graphs ran)

    def accepts(self, seqs: Sequence[ScheduledSequence]) -> bool:
        """A pure decode step that fits the largest bucket, of sequences with rows in the
        persistent table. Pure decode (`ScheduledSequence.decode`): one token past the prompt
        per row; a 1-token prompt chunk is not one (its prompt logprobs, a vision model's image
        rows and unshifted rotary positions are the eager forward's)."""
        return (
            0 < len(seqs) <= self.buckets[-1]
            and self.table is not None
            and all(s.decode and len(s.token_ids) == 1 and s.table_row is not None for s in seqs)
        )

    def forward(self, seqs: Sequence[ScheduledSequence]) -> Tensor:
        """Final hidden states [number of sampling sequences, hidden] of a decode step."""
        key = graph_key(seqs, self.buckets, self.context_buckets) if self.accepts(seqs) else None
        if key is None:
            raise ValueError("DecodeGraphRunner.forward needs a decode batch that accepts() took")
        graph, hidden = self._graphs.get(key) or self._capture(*key)
        self.static.fill(seqs, key[0], self.block_size, self.table)
        graph.replay()
        self.num_replays += 1
        sampling_rows = [row for row, seq in enumerate(seqs) if seq.sample]
        if len(sampling_rows) == len(seqs):
            return hidden[: len(seqs)]
        return hidden[torch.tensor(sampling_rows, dtype=torch.int64, device=self.device)]

    def capture(self, num_seqs: int, context: int) -> None:
        """Capture now (if not yet) the graph a decode step of `num_seqs` rows whose longest
        context is `context` would replay (start-up profiling and self-checks)."""
        key = bucket_for(num_seqs, self.buckets), bucket_for(context, self.context_buckets)
        if None in key:
            raise ValueError(f"no graph holds {num_seqs} rows at context {context}")
        if key not in self._graphs:
            self._capture(*key)

    def capture_all(self) -> None:
        """Capture every batch bucket now at the capacity context, in `capture_plan`'s order
        (start time: the memory profile counts the largest split-K scratch, the self-check
        replays); the other context buckets are captured on first use."""
        for bucket, context in capture_plan(self.buckets[-1], self.max_model_len):
            if (bucket, context) not in self._graphs:
                self._capture(bucket, context)

    @property
    def num_captured(self) -> int:
        return len(self._graphs)

    @property
    def captured(self) -> frozenset[tuple[int, int]]:
        """The (batch bucket, context bucket) keys of the graphs held now."""
        return frozenset(self._graphs)

    @property
    def max_graphs(self) -> int:
        """The most graphs this runner captures: one per (batch bucket, context bucket)."""
        return len(self.buckets) * len(self.context_buckets)

    def invalidate(self) -> None:
        """Forget every graph (and its memory pool); the next decode step captures anew."""
        self._graphs.clear()
        self._pool = None

    def _run(self, bucket: int, context: int) -> Tensor:
        s = self.static
        meta = s.metadata(bucket, context)
        return self.model(s.input_ids[:bucket], s.positions[:bucket], self.kv_cache, meta)

    def _capture(self, bucket: int, context: int) -> tuple[torch.cuda.CUDAGraph, Tensor]:
        """Warm up and capture under inference mode, wherever it is called from (start-up
        profiling, the self-check, a first use): with autograd recording, each graph would keep
        its autograd graph and pin its activations in the shared pool, so graph memory would
        be the sum over buckets instead of about the largest one."""
        with torch.inference_mode():
            return self._capture_inference(bucket, context)

    def _capture_inference(self, bucket: int, context: int) -> tuple[torch.cuda.CUDAGraph, Tensor]:
        self.static.pad(bucket)
        current = torch.cuda.current_stream(self.device)
        if self._warmup_stream is None:
            self._warmup_stream = torch.cuda.Stream(self.device)
        side = self._warmup_stream
        side.wait_stream(current)
        with torch.cuda.stream(side):
            for _ in range(WARMUP_RUNS):
                self._run(bucket, context)
        current.wait_stream(side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        # thread_local: a capture on the step thread must not turn another thread's unrelated
        # CUDA call (e.g. the gRPC side's) into a capture error, nor be broken by it.
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            hidden = self._run(bucket, context)
        self._graphs[bucket, context] = (graph, hidden)
        return graph, hidden
