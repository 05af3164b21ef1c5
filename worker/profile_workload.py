"""The worst steps a server can send, run once at start for the memory profile.

A `ProfileWorkload` (worker/memory_profile.py) over the worker's real model, backend and
sampler, against a stand-in KV pool just big enough for its own tokens (the real pool is
sized from the measurement, then allocated; the stand-in is freed first):

    forwards  the largest prefill: max_num_batched_tokens tokens, as few sequences as
              max_model_len allows (at most the decode batch), each sampling its last token;
              then the largest decode batch: max_batch sequences of one token each, with the
              attention planned for max_model_len (as a graph replay plans it: the split-K
              scratch at its largest) on CUDA
    sampler   logits [max_batch, vocab] through the sampler with temperature, top-k, top-p,
              min-p, logprobs and 20 top_logprobs on (its largest buffers)
    graphs    every decode bucket captured (DecodeGraphRunner.capture_all) when graphs are on

Token ids are arbitrary (in range): activation sizes do not depend on them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from base.logs import get_logger
from base.plan import KVLayout, MemoryBreakdown
from base.sampling import SamplingParams
from worker.batch import ScheduledSequence, blocks_needed, build_model_inputs
from worker.cuda_graph import DecodeGraphRunner
from worker.kv_cache import KVCacheSpec, create_kv_cache
from worker.memory_profile import CudaMemory, DeviceMemory, breakdown, choose_kv_bytes, measure
from worker.sampler import Sampler, SamplingRow
from worker.worker_config import WorkerConfig, kv_sizing, resolve_device

log = get_logger("pagedkv.worker")

WORST_SAMPLING = SamplingParams(
    temperature=1.0, top_k=50, top_p=0.9, min_p=0.05, logprobs=True, top_logprobs=20
)


@dataclass(frozen=True, slots=True)
class ProfileShape:
    """What the server allows in one step."""

    max_num_batched_tokens: int
    max_batch: int  # decode sequences per step (the control plane's max_num_seqs)
    max_model_len: int

    def prefill_lengths(self) -> list[int]:
        """The largest prefill as sequence lengths: max_model_len each, the rest in the last."""
        tokens = min(self.max_num_batched_tokens, self.max_batch * self.max_model_len)
        full, rest = divmod(tokens, self.max_model_len)
        return [self.max_model_len] * full + ([rest] if rest else [])


class WorkerProfileWorkload:
    def __init__(
        self,
        model: nn.Module,
        spec: KVCacheSpec,
        layout: KVLayout,
        backend,
        device: torch.device,
        shape: ProfileShape,
        vocab_size: int,
        capture: bool,
        capture_failed: Callable[[Exception], None] | None = None,
    ) -> None:
        """`vocab_size`: the whole vocabulary (a tensor-parallel rank's model holds a part;
        its sampler sees the gathered logits). `capture_failed`: called with a failed capture's
        error before it is logged (a tensor-parallel rank raises: its group stops)."""
        self.model, self.device, self.shape = model, device, shape
        self.vocab_size, self.capture, self.capture_failed = vocab_size, capture, capture_failed
        self.prefill = shape.prefill_lengths()
        if layout == KVLayout.PAGED:
            need = max(sum(blocks_needed(n, spec.block_size) for n in self.prefill), shape.max_batch)
            self.pool = create_kv_cache(spec, layout, backend, device, shape.max_model_len, need + 1, 0)
        else:  # one max-length row, which every sequence writes (their K/V are never read back)
            memory = spec.bytes_per_token * shape.max_model_len
            self.pool = create_kv_cache(spec, layout, backend, device, shape.max_model_len, None, memory)
        self.graphs: DecodeGraphRunner | None = None

    def _tables(self, lengths: list[int]) -> list[list[int]]:
        """Tables over the stand-in pool: disjoint blocks from 1 (paged); the one row (a
        contiguous pool's rows are max_model_len each: one per sequence could be gigabytes)."""
        unit = self.pool.addressing_block_size
        if self.pool.layout != KVLayout.PAGED:
            return [[0] for _ in lengths]
        tables, next_block = [], 1
        for n in lengths:
            count = blocks_needed(n, unit)
            tables.append(list(range(next_block, next_block + count)))
            next_block += count
        return tables

    def _forward(self, seqs: list[ScheduledSequence], capacity_plan: bool) -> None:
        inputs = build_model_inputs(seqs, self.pool.addressing_block_size, self.device)
        meta = inputs.attention
        if capacity_plan:  # plan the split-K for max_model_len, as a replay does
            meta.max_seq_len = self.shape.max_model_len
            meta.host_seq_lens = None
        hidden = self.model(inputs.input_ids, inputs.positions, self.pool, meta)
        self.model.compute_logits(hidden[inputs.logits_indices])

    def run_forwards(self) -> None:
        ids = [i % self.vocab_size for i in range(max(self.prefill, default=1))]
        with torch.inference_mode():
            prefill = [
                ScheduledSequence(table, ids[:n], 0, sample=True)
                for table, n in zip(self._tables(self.prefill), self.prefill, strict=True)
            ]
            self._forward(prefill, capacity_plan=False)
            batch = self.shape.max_batch
            decode = [ScheduledSequence(t, [1], 0, sample=True) for t in self._tables([1] * batch)]
            self._forward(decode, capacity_plan=self.device.type == "cuda")

    def run_sampler(self) -> None:
        batch = self.shape.max_batch
        logits = torch.randn(batch, self.vocab_size, generator=torch.Generator().manual_seed(0))
        rows = [SamplingRow(WORST_SAMPLING, sample_index=0, position=0) for _ in range(batch)]
        Sampler(seed=0).sample(logits.to(self.device), rows)

    def capture_graphs(self) -> None:
        if not self.capture or self.pool.layout != KVLayout.PAGED:
            return
        shape = self.shape
        self.graphs = DecodeGraphRunner(
            self.model, self.pool, shape.max_model_len, shape.max_batch, self.device
        )
        try:
            self.graphs.capture_all()  # under inference mode (DecodeGraphRunner._capture)
        except (RuntimeError, ValueError) as exc:  # the self-check meets it again and decides
            self.graphs.invalidate()
            if self.capture_failed is not None:  # a tensor-parallel rank: raises, its group stops
                self.capture_failed(exc)
            log.warning("worker.memory_profile_no_graphs", reason=f"graph capture failed: {exc}")

    def release(self) -> None:
        if self.graphs is not None:
            self.graphs.invalidate()
        self.graphs = None
        self.pool = None


def profiled_kv_bytes(
    config: WorkerConfig,
    model: nn.Module,
    spec: KVCacheSpec,
    backend,
    max_model_len: int,
    memory: DeviceMemory | None = None,
    vocab_size: int | None = None,
    capture_failed: Callable[[Exception], None] | None = None,
) -> tuple[int, MemoryBreakdown]:
    """CUDA: profile this workload (memory_profile.measure), then the pool's bytes under
    config.gpu_memory_utilization (an explicit size wins) and the breakdown so far.
    `memory` defaults to the CUDA device's figures (tests pass a fake); `vocab_size` to the
    model's; `capture_failed`: WorkerProfileWorkload's."""
    device = resolve_device(config.device)
    shape = ProfileShape(config.max_num_batched_tokens, config.cuda_graph_max_batch_size, max_model_len)
    capture = config.graph_mode != "off" and device.type == "cuda"  # graphs exist on CUDA only
    vocab = vocab_size or model.config.vocab_size
    use = measure(
        memory or CudaMemory(device),
        lambda: WorkerProfileWorkload(
            model, spec, config.layout, backend, device, shape, vocab, capture, capture_failed
        ),
    )
    if config.layout == KVLayout.PAGED:
        one_sequence = (blocks_needed(max_model_len, spec.block_size) + 1) * spec.bytes_per_block
    else:
        one_sequence = spec.bytes_per_token * max_model_len
    explicit = config.kv_cache_memory
    if config.num_blocks is not None:
        explicit = config.num_blocks * spec.bytes_per_block
    utilization = config.gpu_memory_utilization
    kv_bytes = choose_kv_bytes(explicit, utilization, use, one_sequence)
    return kv_bytes, breakdown(kv_sizing(config, profiled=True), 0, use.weights, use, utilization)
