"""The physical KV memory: the paged pool, and the contiguous baseline.

Paged (the real thing), one K and one V pool per layer:

    k_caches[layer]  [num_blocks, block_size, num_kv_heads, head_dim]
                      ^ block id: the same id names the same slot range in every layer,
                        so a sequence has one block table, not one per layer.
    block 0 = the null block: never handed to a sequence; padded table entries point at it.

Contiguous (the baseline `--kv-layout contiguous`), one row of max_model_len tokens per
live sequence, reserved whole when the sequence is registered:

    k_caches[layer]  [num_rows, max_model_len, num_kv_heads, head_dim]

Quantized (`--kv-cache-dtype fp8_e4m3|fp8_e5m2|int8`, paged only): the pools hold uint8 codes
and each layer has two more pools of scale bytes, block id first so block copies carry them:

    k_exps[layer]    [num_blocks, block_size, num_kv_heads]   one scale byte per (slot, kv head)

(worker/kv_quant.py says why and holds the torch oracle; the C kernels read codes and bytes.)

A contiguous row is addressed exactly like one block of size max_model_len (table = [row]),
so batch preparation and KV writes are shared; attention slices the row instead of
gathering through a table. It cannot share KV between sequences, so prefix hits and
copy-on-write are refused by plan validation. It reports enough "blocks" for
num_rows * max_model_len tokens (+ the null block) so the control plane's accounting works,
and `max_concurrent_seqs = num_rows` so it never schedules more sequences than rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Protocol

import torch
from torch import Tensor

from base.plan import KVLayout
from worker.backends.base import AttentionBackend
from worker.backends.cpu import CpuAttentionBackend, attention_over_context
from worker.batch import AttentionMetadata, blocks_needed
from worker.errors import WorkerConfigError
from worker.kv_quant import KVFormat, KvQuantPools, dequantize, quantize


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    """Per-token and per-block memory of the KV cache of one model."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    block_size: int
    kv_format: KVFormat | None = None  # quantized pools (codes + a scale byte per kv head)

    @property
    def bytes_per_token(self) -> int:
        if self.kv_format is not None:  # 1-byte codes and one scale byte per head
            return 2 * self.num_layers * self.num_kv_heads * (self.head_dim + 1)
        element_size = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * element_size

    @property
    def bytes_per_block(self) -> int:
        """2 (K and V) * layers * kv_heads * head_dim * dtype bytes * block_size; quantized:
        2 * layers * kv_heads * (head_dim + 1 scale byte) * block_size."""
        return self.bytes_per_token * self.block_size

    @property
    def kv_cache_dtype(self) -> str:
        """What the pools hold: "fp8_e4m3" | "fp8_e5m2" | "int8", else the model's dtype."""
        return self.kv_format.name if self.kv_format else str(self.dtype).removeprefix("torch.")


class KVCache(Protocol):
    """What the model and the worker need from either layout."""

    layout: KVLayout
    addressing_block_size: int  # block_size (paged) or max_model_len (contiguous row)
    reported_num_blocks: int  # WorkerInfo.num_blocks, including the null block
    max_concurrent_seqs: int  # 0 = no limit
    num_free_rows: int  # contiguous rows not assigned to a sequence (0 for the paged layout)

    def physical_table(self, seq_id: int, block_ids: Sequence[int]) -> Sequence[int]: ...
    def register(self, seq_id: int) -> None: ...
    def release(self, seq_id: int) -> None: ...
    def reset(self) -> None: ...
    def write(self, layer: int, key: Tensor, value: Tensor, meta: AttentionMetadata) -> None: ...
    def attend(
        self, layer: int, query: Tensor, meta: AttentionMetadata, scale: float, window: int = 0
    ) -> Tensor: ...
    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None: ...


class PagedKVCache:
    layout = KVLayout.PAGED

    def __init__(
        self,
        spec: KVCacheSpec,
        num_blocks: int,
        backend: AttentionBackend,
        device: torch.device | str,
        tensor_scales: tuple[list[float], list[float]] | None = None,
    ) -> None:
        """tensor_scales: a quantized pool's per-layer checkpoint scales (k, v); None: computed
        per (token, kv head) as tokens are stored (0.0 in k_scales / v_scales)."""
        if num_blocks < 2:
            raise WorkerConfigError(
                f"the paged KV pool needs at least 2 blocks (block 0 is the null block), got {num_blocks}; "
                "raise the KV cache memory or num_blocks"
            )
        shape = (num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
        self.spec = spec
        self.backend = backend
        self.device = torch.device(device)
        self.kv_format = spec.kv_format
        pool_dtype = spec.dtype if spec.kv_format is None else torch.uint8
        self.k_caches = [torch.zeros(shape, dtype=pool_dtype, device=device) for _ in range(spec.num_layers)]
        self.v_caches = [torch.zeros(shape, dtype=pool_dtype, device=device) for _ in range(spec.num_layers)]
        # Quantized only: scale bytes (worker/kv_quant.py), 1 until a token is stored (never read before).
        exps = 0 if spec.kv_format is None else spec.num_layers
        self.k_exps = [torch.ones(shape[:-1], dtype=torch.uint8, device=device) for _ in range(exps)]
        self.v_exps = [torch.ones(shape[:-1], dtype=torch.uint8, device=device) for _ in range(exps)]
        self.k_scales, self.v_scales = tensor_scales or ([0.0] * exps, [0.0] * exps)
        self.addressing_block_size = spec.block_size
        self.reported_num_blocks = num_blocks
        self.max_concurrent_seqs = 0
        self.num_free_rows = 0  # no rows: sequences own only the blocks the plan gives them

    def physical_table(self, seq_id: int, block_ids: Sequence[int]) -> Sequence[int]:
        return block_ids

    def register(self, seq_id: int) -> None:
        """Paged sequences own only the blocks the plan gives them: nothing to reserve."""

    def release(self, seq_id: int) -> None:
        """Blocks are freed by the control plane; nothing to do here."""

    def reset(self) -> None:
        """Nothing is owned per sequence."""

    def _kernel_quant(self, layer: int) -> KvQuantPools | None:
        """A quantized layer's pools for a backend whose kernels serve them (CUDA); None for
        the model's dtype or the CPU reference backend (which reads the torch oracle)."""
        if self.kv_format is None or not getattr(self.backend, "serves_quantized_kv", False):
            return None
        return KvQuantPools(
            self.kv_format.name,
            self.k_exps[layer],
            self.v_exps[layer],
            self.k_scales[layer],
            self.v_scales[layer],
        )

    def write(self, layer: int, key: Tensor, value: Tensor, meta: AttentionMetadata) -> None:
        quant = self._kernel_quant(layer)
        if quant is not None:
            self.backend.write_kv_quantized(
                self.k_caches[layer], self.v_caches[layer], key, value, meta.slot_mapping, quant
            )
            return
        if self.kv_format is not None:
            self._write_quantized(layer, key, value, meta.slot_mapping)
            return
        self.backend.write_kv(self.k_caches[layer], self.v_caches[layer], key, value, meta.slot_mapping)

    def _write_quantized(self, layer: int, key: Tensor, value: Tensor, slot_mapping: Tensor) -> None:
        """The reference forward's store: kv_quant.quantize, the oracle of the C store."""
        keep = slot_mapping >= 0
        slots, key, value = slot_mapping[keep], key[keep], value[keep]
        kv_heads, head_dim = self.spec.num_kv_heads, self.spec.head_dim
        for pool, exps, x, tensor_scale in (
            (self.k_caches[layer], self.k_exps[layer], key, self.k_scales[layer]),
            (self.v_caches[layer], self.v_exps[layer], value, self.v_scales[layer]),
        ):
            codes, byte = quantize(x, self.kv_format, tensor_scale)
            pool.view(-1, kv_heads, head_dim).index_copy_(0, slots, codes)
            exps.view(-1, kv_heads).index_copy_(0, slots, byte)

    def _decode(self, layer: int, slots: Tensor, keys: Tensor, values: Tensor) -> tuple[Tensor, Tensor]:
        """Gathered codes of `slots` as fp32 (the reference attention's context only)."""
        kv_heads = self.spec.num_kv_heads
        k_byte = self.k_exps[layer].view(-1, kv_heads).index_select(0, slots)
        v_byte = self.v_exps[layer].view(-1, kv_heads).index_select(0, slots)
        return (
            dequantize(keys, k_byte, self.kv_format, self.k_scales[layer]),
            dequantize(values, v_byte, self.kv_format, self.v_scales[layer]),
        )

    def attend(
        self, layer: int, query: Tensor, meta: AttentionMetadata, scale: float, window: int = 0
    ) -> Tensor:
        """window > 0: a sliding-window layer (only the CPU reference backend takes one: the
        worker refuses windowed models on CUDA at start)."""
        extra: dict = {"window": window} if window else {}
        quant = self._kernel_quant(layer)
        if self.kv_format is not None and quant is None:  # the CPU reference: the oracle decodes
            extra["kv_decode"] = partial(self._decode, layer)
        else:
            extra.update(num_decode_seqs=meta.num_decode_seqs, host_seq_lens=meta.host_seq_lens)
            if quant is not None:
                extra["kv_quant"] = quant
        return self.backend.paged_attention(
            query,
            self.k_caches[layer],
            self.v_caches[layer],
            meta.sequence_tables(-(-meta.max_seq_len // self.addressing_block_size)),
            meta.seq_lens,
            meta.query_start_loc,
            scale,
            meta.max_query_len,
            meta.max_seq_len,
            **extra,
        )

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copies take effect in list order; each conflict-free run is one batched copy."""
        for batch in copy_batches(pairs):
            block_pairs = torch.tensor(batch, dtype=torch.int64, device=self.device)
            # a quantized block's scale bytes are copied with it (they are block-indexed pools too)
            self.backend.copy_blocks(
                [*self.k_caches, *self.k_exps], [*self.v_caches, *self.v_exps], block_pairs
            )


class ContiguousKVCache:
    """Max-length rows, one per live sequence: the memory-hungry baseline paging is compared to.

    NOTE: its attention is the torch reference (`attention_over_context` on a row slice) on
    every device; KV writes use the reference scatter. On CUDA this measures torch ops, not
    kernels, until a backend supplies a contiguous kernel.
    """

    layout = KVLayout.CONTIGUOUS
    kv_format = None  # the baseline stores the model's dtype only

    def __init__(
        self, spec: KVCacheSpec, num_rows: int, max_model_len: int, device: torch.device | str
    ) -> None:
        if num_rows < 1:
            raise WorkerConfigError(
                f"the contiguous KV layout needs room for at least one {max_model_len}-token row "
                f"({spec.bytes_per_token * max_model_len} bytes); raise the KV cache memory or "
                "lower max_model_len"
            )
        shape = (num_rows, max_model_len, spec.num_kv_heads, spec.head_dim)
        self.spec = spec
        self.k_caches = [torch.zeros(shape, dtype=spec.dtype, device=device) for _ in range(spec.num_layers)]
        self.v_caches = [torch.zeros(shape, dtype=spec.dtype, device=device) for _ in range(spec.num_layers)]
        self.addressing_block_size = max_model_len
        self.reported_num_blocks = blocks_needed(num_rows * max_model_len, spec.block_size) + 1
        self.max_concurrent_seqs = num_rows
        self._reference_ops = CpuAttentionBackend()
        self._free_rows = list(range(num_rows - 1, -1, -1))  # a stack: row 0 is handed out first
        self._row_of: dict[int, int] = {}

    @property
    def num_free_rows(self) -> int:
        return len(self._free_rows)

    def physical_table(self, seq_id: int, block_ids: Sequence[int]) -> Sequence[int]:
        return (self._row_of[seq_id],)

    def register(self, seq_id: int) -> None:
        if not self._free_rows:
            raise AssertionError("no free contiguous row: plan validation should have refused this plan")
        self._row_of[seq_id] = self._free_rows.pop()

    def release(self, seq_id: int) -> None:
        self._free_rows.append(self._row_of.pop(seq_id))

    def reset(self) -> None:
        for seq_id in list(self._row_of):
            self.release(seq_id)

    def write(self, layer: int, key: Tensor, value: Tensor, meta: AttentionMetadata) -> None:
        self._reference_ops.write_kv(
            self.k_caches[layer], self.v_caches[layer], key, value, meta.slot_mapping
        )

    def attend(
        self, layer: int, query: Tensor, meta: AttentionMetadata, scale: float, window: int = 0
    ) -> Tensor:
        k_cache, v_cache = self.k_caches[layer], self.v_caches[layer]
        output = torch.empty_like(query)
        starts = meta.query_start_loc.tolist()
        rows = meta.block_tables[:, 0].tolist()
        for s, seq_len in enumerate(meta.seq_lens.tolist()):
            q_begin, q_end = starts[s], starts[s + 1]
            if q_end > q_begin:
                row = rows[s]
                output[q_begin:q_end] = attention_over_context(
                    query[q_begin:q_end], k_cache[row, :seq_len], v_cache[row, :seq_len], scale, window
                )
        return output

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        if pairs:
            raise AssertionError("the contiguous KV layout cannot copy blocks: plan validation refuses this")


def copy_batches(pairs: Sequence[tuple[int, int]]) -> list[list[tuple[int, int]]]:
    """Split copies into consecutive runs that one batched launch may run in any order.

    Plan.copies take effect in list order. A batched copy runs its pairs in parallel, so a run
    ends before a pair that reads a block the run writes, or writes a block the run reads: e.g.
    (S->D), (T->S) -- S was a copy-on-write source, then freed by a preemption and handed out
    again as a destination in the same step -- becomes two runs, and D gets S's old contents.
    """
    batches: list[list[tuple[int, int]]] = []
    reads: set[int] = set()
    writes: set[int] = set()
    for src, dst in pairs:
        if not batches or src in writes or dst in reads or dst in writes:
            batches.append([])
            reads, writes = set(), set()
        batches[-1].append((src, dst))
        reads.add(src)
        writes.add(dst)
    return batches


def create_kv_cache(
    spec: KVCacheSpec,
    layout: KVLayout,
    backend: AttentionBackend,
    device: torch.device | str,
    max_model_len: int,
    num_blocks: int | None,
    memory_bytes: int,
    tensor_scales: tuple[list[float], list[float]] | None = None,
) -> PagedKVCache | ContiguousKVCache:
    """Size and allocate the cache: an explicit `num_blocks` wins, else `memory_bytes`.

    paged:      num_blocks = memory_bytes // bytes_per_block
    contiguous: rows = memory_bytes // (bytes_per_token * max_model_len); with an explicit
                num_blocks, as many rows as the same number of paged blocks would hold, so
                the two layouts compare at an equal KV budget.
    """
    if layout == KVLayout.PAGED:
        blocks = num_blocks if num_blocks is not None else memory_bytes // spec.bytes_per_block
        return PagedKVCache(spec, blocks, backend, device, tensor_scales)
    if spec.kv_format is not None:
        raise WorkerConfigError(
            f"--kv-cache-dtype {spec.kv_format.name}: the contiguous layout (the baseline) stores KV in the "
            "model's dtype only; use --kv-layout paged"
        )
    if num_blocks is not None:
        rows = max(num_blocks - 1, 0) * spec.block_size // max_model_len
    else:
        rows = memory_bytes // (spec.bytes_per_token * max_model_len)
    return ContiguousKVCache(spec, rows, max_model_len, device)
