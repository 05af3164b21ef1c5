"""Launch geometry and kernel-argument packing: pure Python, no GPU, tested in CI.

Everything a launch needs besides device pointers is decided here, from shapes and fixed
limits only, so that the CUDA backend stays a thin layer and CUDA-graph safety can be
checked without a device:

  - `plan_decode` picks single-pass or split-K, and the partition size, for the decode
    kernel from the SM count and the rows' context lengths (a makespan model). A CUDA graph
    cannot know the lengths: it passes none and the buffer capacity (max_model_len) as the
    bound, so grid and shared memory are the same on every replay and the kernels skip
    partitions past each row's real context.
  - `prefill_grid` sizes the tensor-core prefill launch.
  - `quant_gemv_launch` / `quant_dequant_launch` size the quantized-linear launches;
    `named_args` packs their arguments by parameter name (checked against the .cu source).
  - `KernelArgs` packs arguments for `cuLaunchKernel(kernelParams=...)`: one ctypes value
    per parameter, in the kernel's declaration order and C type, plus the `void*[]` that
    points at them. Python ints are not self-describing (an `int` vs a `long long` parameter
    differ in size), so every argument carries its explicit type.
"""

from __future__ import annotations

import ctypes
import functools
import struct
from collections.abc import Sequence
from dataclasses import dataclass

from kernels.specs import (
    COPY_BLOCKS_THREADS,
    DECODE_THREADS,
    DEQUANT_THREADS,
    GEMV_ROW_BUCKETS,
    PREFILL_BLOCK_M,
    PREFILL_THREADS,
    QUANT_ALIGN,
    QUANT_GEMV_COLS,
    QUANT_GEMV_THREADS,
    REDUCE_THREADS,
    WRITE_KV_THREADS,
    codes_per_word,
    decode_smem_bytes,
)

# Split-K partition sizes the planner chooses from (keys). Only those that are multiples of
# the block size are used: a partition must start on a block boundary (the decode kernel).
PARTITION_CHOICES = (128, 256, 512, 1024, 2048, 4096)
MAX_PARTITION_TOKENS = PARTITION_CHOICES[-1]
# Decode CTAs resident per SM the planner counts on (the GQA-8 instantiations need ~230
# registers x 128 threads: two fit in 64 K registers).
TARGET_CTAS_PER_SM = 2
# Cost model of plan_decode, in keys of one CTA (at ~3.3 TB/s over 132 SMs x 2 CTAs, one
# fp16 key+value of head_dim 128 takes ~40 ns): a CTA's fixed work (start, q load, merge),
# ~2.5 us, and a split's reduce launch, ~10 us with its launch gap. Estimates until
# bench/gpu.py's decode sweep calibrates them on a device.
CTA_FIXED_KEYS = 64
REDUCE_KEYS = 256
# Dynamic shared memory available without cuFuncSetAttribute.
DEFAULT_DYNAMIC_SMEM_LIMIT = 48 * 1024

# C parameter types, by the names used in the kernels' signatures.
PTR = ctypes.c_void_p
I32 = ctypes.c_int32
I64 = ctypes.c_int64
F32 = ctypes.c_float

WRITE_KV_SIGNATURE = (PTR, PTR, PTR, PTR, PTR, I64, I64, I32)
COPY_BLOCKS_SIGNATURE = (PTR, PTR, I64)
DECODE_SIGNATURE = (PTR, PTR, PTR, PTR, I64, PTR, PTR, PTR, I32, PTR, PTR, I32, I32, I32, F32, I32)
REDUCE_SIGNATURE = (PTR, PTR, PTR, PTR, PTR, I32, I32, I32)
PREFILL_SIGNATURE = (PTR, PTR, I64, PTR, PTR, PTR, I32, PTR, PTR, I32, I32, F32)
# Quantized KV pools (issue 31): the attention kernels take their unquantized arguments, then
# (k scale bytes, v scale bytes, k tensor scale, v tensor scale).
KV_SCALES_SIGNATURE = (PTR, PTR, F32, F32)
WRITE_KV_QUANT_SIGNATURE = (PTR, PTR, PTR, PTR, PTR, PTR, PTR, I64, I64, I32, F32, F32)
DECODE_QUANT_SIGNATURE = DECODE_SIGNATURE + KV_SCALES_SIGNATURE
PREFILL_QUANT_SIGNATURE = PREFILL_SIGNATURE + KV_SCALES_SIGNATURE
# The quantized-linear kernels' parameters by name (quant_linear.cu), for `named_args`.
QUANT_GEMV_PARAMS = (
    ("y", PTR), ("x", PTR), ("x_stride", I64), ("qweight", PTR), ("qparams", PTR), ("bias", PTR),
    ("rows", I32), ("n", I32), ("k", I32), ("group_size", I32),
)  # fmt: skip
QUANT_DEQUANT_PARAMS = (
    ("out", PTR),
    ("qweight", PTR),
    ("qparams", PTR),
    ("n", I32),
    ("k", I32),
    ("group_size", I32),
)
QUANT_GEMV_SIGNATURE = tuple(ctype for _, ctype in QUANT_GEMV_PARAMS)
QUANT_DEQUANT_SIGNATURE = tuple(ctype for _, ctype in QUANT_DEQUANT_PARAMS)


class KernelArgs:
    """Arguments of one launch, packed as the driver expects: `pointer` is the address of a
    `void*[n]` whose i-th entry points at the i-th value. The object owns the storage; keep it
    alive until cuLaunchKernel returns (the driver copies the values at launch, also when the
    launch is being captured into a CUDA graph).

    All values live in one buffer laid out like the C struct of the parameters (layout and
    format computed once per signature), filled by a single `struct.pack_into`; the pointer
    array is built from precomputed offsets. One ctypes object per value cost ~70 us for a
    16-argument launch (eager steps pay it three times per layer); this costs a few us
    (`make bench`, suite launch_args)."""

    __slots__ = ("_signature", "_buffer")

    def __init__(self, signature: Sequence[type], values: Sequence[object]) -> None:
        if len(signature) != len(values):
            raise ValueError(f"kernel takes {len(signature)} arguments, got {len(values)}")
        layout = _layout(tuple(signature))
        self._signature = signature
        # [void* array | values]: one allocation, one pack_into for both.
        self._buffer = ctypes.create_string_buffer(layout.size)
        base = ctypes.addressof(self._buffer)
        try:
            struct.pack_into(layout.format, self._buffer, 0, *[base + o for o in layout.offsets], *values)
        except struct.error as exc:
            raise OverflowError(f"kernel arguments {list(values)} do not fit {layout.format}: {exc}") from exc

    @property
    def pointer(self) -> int:
        return ctypes.addressof(self._buffer)

    def read_back(self) -> list[object]:
        """The values as the kernel will see them, read through the pointer array (tests)."""
        pointers = (ctypes.c_void_p * len(self._signature)).from_address(self.pointer)
        return [ctype.from_address(a).value for ctype, a in zip(self._signature, pointers, strict=True)]


@dataclass(frozen=True, slots=True)
class _ArgLayout:
    format: str  # struct format, native alignment: n pointers, then the parameters' C layout
    offsets: tuple[int, ...]  # of each value from the buffer's start
    size: int


_STRUCT_CODES = {PTR: "P", I32: "i", I64: "q", F32: "f"}


@functools.cache
def _layout(signature: tuple[type, ...]) -> _ArgLayout:
    head = "@" + "P" * len(signature)  # the void*[n] the driver reads
    codes = [_STRUCT_CODES[ctype] for ctype in signature]
    offsets = [
        struct.calcsize(head + "".join(codes[: i + 1])) - struct.calcsize("@" + c)
        for i, c in enumerate(codes)
    ]
    fmt = head + "".join(codes)
    return _ArgLayout(fmt, tuple(offsets), max(struct.calcsize(fmt), 1))


POOL_ALIGN = 16  # bytes: the kernels read K/V rows with 16-byte vector loads


def check_kv_pools(k_cache, v_cache) -> None:
    """The kernels index a layer's pools as dense [blocks, block_size, kv_heads, head_dim]
    arrays from their base pointers: refuse views, strides or offsets that would make them read
    the wrong memory (torch tensors, or anything with shape/stride/dtype/data_ptr)."""
    for name, pool in (("k_cache", k_cache), ("v_cache", v_cache)):
        if len(pool.shape) != 4:
            raise ValueError(
                f"{name} must be [num_blocks, block_size, num_kv_heads, head_dim], got {tuple(pool.shape)}"
            )
        expected, step = [], 1
        for size in reversed(pool.shape):
            expected.insert(0, step)
            step *= size
        if tuple(pool.stride()) != tuple(expected):
            raise ValueError(
                f"{name} must be contiguous (strides {tuple(expected)}), got {tuple(pool.stride())}"
            )
        if pool.data_ptr() % POOL_ALIGN:
            raise ValueError(
                f"{name} must start on a {POOL_ALIGN}-byte boundary (address {pool.data_ptr():#x})"
            )
    if tuple(k_cache.shape) != tuple(v_cache.shape) or k_cache.dtype != v_cache.dtype:
        raise ValueError(
            f"k_cache and v_cache must match: {tuple(k_cache.shape)} {k_cache.dtype} vs "
            f"{tuple(v_cache.shape)} {v_cache.dtype}"
        )


@dataclass(frozen=True, slots=True)
class LaunchConfig:
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    smem_bytes: int = 0


@dataclass(frozen=True, slots=True)
class DecodePlan:
    """How the decode kernel covers `rows` query rows with contexts up to `max_seq_len`.

    num_partitions == 1: one CTA per (row, head chunk) walks the whole context, which must be
    <= partition_tokens (the kernel stops at partition_tokens), and writes the output.
    num_partitions > 1: each CTA covers partition_tokens keys and writes a partial; the
    reduce kernel merges them. CTAs whose partition starts past their row's context exit.
    """

    rows: int
    ctas_per_row: int  # kv_heads * head_chunks
    num_partitions: int
    partition_tokens: int
    block_size: int

    @property
    def attention(self) -> LaunchConfig:
        return LaunchConfig(
            grid=(self.rows, self.ctas_per_row, self.num_partitions),
            block=(DECODE_THREADS, 1, 1),
            smem_bytes=decode_smem_bytes(self.partition_tokens, self.block_size),
        )

    def reduce(self, num_heads: int) -> LaunchConfig:
        return LaunchConfig(grid=(self.rows, num_heads, 1), block=(REDUCE_THREADS, 1, 1))

    @property
    def split(self) -> bool:
        return self.num_partitions > 1

    def partial_shapes(self, num_heads: int, head_dim: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """fp32 workspace shapes (acc, (max, sum)) of a split launch."""
        return (
            (self.rows, num_heads, self.num_partitions, head_dim),
            (self.rows, num_heads, self.num_partitions, 2),
        )


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def plan_decode(
    rows: int,
    max_seq_len: int,
    block_size: int,
    ctas_per_row: int,
    num_sms: int,
    dynamic_smem_limit: int = DEFAULT_DYNAMIC_SMEM_LIMIT,
    row_contexts: Sequence[int] | None = None,
) -> DecodePlan:
    """Choose single-pass or split-K, and the partition size, by a makespan model.

    `row_contexts` are the rows' context lengths when the host knows them (eager steps); a
    CUDA graph passes None and every row is taken at `max_seq_len` (its context bucket), so
    the plan depends on the two buckets only and equals an eager plan at the bucket's length.
    For each candidate (one pass, or partitions of `PARTITION_CHOICES` tokens) the cost is
    the larger of the work spread over `num_sms * TARGET_CTAS_PER_SM` resident CTAs and the
    longest single CTA, in keys, with `CTA_FIXED_KEYS` per CTA and `REDUCE_KEYS` for a split's
    reduce launch. So batch 1 at a long context splits until the SMs are full, a skewed batch
    splits its long row, and a large uniform batch stays single-pass. One pass must also fit
    its block ids in
    `dynamic_smem_limit`.
    """
    if rows < 1 or ctas_per_row < 1:
        raise ValueError(f"decode launch needs rows >= 1 and ctas_per_row >= 1, got {rows}, {ctas_per_row}")
    max_seq_len = max(max_seq_len, 1)
    contexts = [max_seq_len] * rows if row_contexts is None else [min(c, max_seq_len) for c in row_contexts]
    slots = max(num_sms, 1) * TARGET_CTAS_PER_SM
    single_tokens = round_up(max_seq_len, block_size)
    best: tuple[float, DecodePlan] | None = None
    if decode_smem_bytes(single_tokens, block_size) <= dynamic_smem_limit:
        cost = _makespan(contexts, ctas_per_row, slots, single_tokens, max_seq_len, split=False)
        best = (cost, DecodePlan(rows, ctas_per_row, 1, single_tokens, block_size))
    for tokens in PARTITION_CHOICES:
        if tokens % block_size or tokens >= max_seq_len:
            continue
        cost = _makespan(contexts, ctas_per_row, slots, tokens, max_seq_len, split=True)
        if best is None or cost < best[0]:
            partitions = -(-max_seq_len // tokens)
            best = (cost, DecodePlan(rows, ctas_per_row, partitions, tokens, block_size))
    if best is None:  # nothing fits: the largest block-aligned partition (tiny block sizes)
        tokens = max(t for t in PARTITION_CHOICES if t % block_size == 0)
        return DecodePlan(rows, ctas_per_row, -(-max_seq_len // tokens), tokens, block_size)
    return best[1]


def step_row_contexts(rows: int, num_seqs: int, host_seq_lens: Sequence[int] | None) -> Sequence[int] | None:
    """What a step passes `plan_decode` as row_contexts: the sequences' lengths when the host
    knows them and rows are sequences (eager decode), else None, so that every row is taken at
    max_seq_len (a CUDA graph, whose max_seq_len is its context bucket: worker/cuda_graph.py)."""
    return host_seq_lens[:num_seqs] if host_seq_lens is not None and rows == num_seqs else None


def _makespan(
    contexts: Sequence[int], ctas_per_row: int, slots: int, tokens: int, longest: int, split: bool
) -> float:
    """Estimated decode time in key-equivalents for partitions of `tokens` keys."""
    ctas = sum(-(-max(c, 1) // tokens) for c in contexts) if split else len(contexts)
    work = ctas_per_row * (sum(contexts) + ctas * CTA_FIXED_KEYS)
    cost = max(work / slots, min(tokens, longest) + CTA_FIXED_KEYS)
    return cost + REDUCE_KEYS if split else cost


@dataclass(frozen=True, slots=True)
class AttentionSplit:
    """Which kernel takes which part of a varlen attention batch.

    Query rows [0, decode_rows), of sequences [0, decode_seqs), go through the decode kernel
    (with num_seqs = decode_seqs, so its row -> sequence search sees only them); sequences
    [prefill_first_seq, S) go through the prefill kernel with the per-sequence arrays offset
    by prefill_first_seq (query_start_loc holds absolute row offsets). No prefill launch when
    prefill_first_seq is None.
    """

    decode_rows: int
    decode_seqs: int
    prefill_first_seq: int | None


def split_attention(
    num_rows: int, num_seqs: int, max_query_len: int, num_decode_seqs: int, tensor_core_prefill: bool
) -> AttentionSplit:
    """Decode rows to the decode kernel, prompts to the prefill kernel, in one step.

    `num_decode_seqs`: how many leading sequences have exactly one query row (the worker
    orders decodes first). Without a tensor-core prefill (fp32) the decode kernel takes every
    row: it is correct for any varlen batch.
    """
    if max_query_len == 1 or not tensor_core_prefill:
        return AttentionSplit(num_rows, num_seqs, None)
    decodes = max(0, min(num_decode_seqs, num_seqs - 1))  # max_query_len > 1: a prompt exists
    return AttentionSplit(decodes, decodes, decodes)


def prefill_launch(max_query_len: int, num_heads: int, num_seqs: int, smem_bytes: int) -> LaunchConfig:
    """Grid (query tiles, heads, sequences); tiles past a sequence's query length exit."""
    tiles = -(-max_query_len // PREFILL_BLOCK_M)
    return LaunchConfig(
        grid=(tiles, num_heads, num_seqs), block=(PREFILL_THREADS, 1, 1), smem_bytes=smem_bytes
    )


def write_kv_launch(num_tokens: int) -> LaunchConfig:
    return LaunchConfig(grid=(num_tokens, 1, 1), block=(WRITE_KV_THREADS, 1, 1))


def copy_blocks_launch(num_pairs: int, num_caches: int) -> LaunchConfig:
    return LaunchConfig(grid=(num_pairs, num_caches, 1), block=(COPY_BLOCKS_THREADS, 1, 1))


def named_args(params: Sequence[tuple[str, type]], **values: object) -> KernelArgs:
    """KernelArgs from values given by parameter name: a swapped pair of same-typed arguments
    (n and k, qweight and qparams) cannot slip through as it could positionally."""
    names = [name for name, _ in params]
    if set(values) != set(names):
        missing, extra = sorted(set(names) - set(values)), sorted(set(values) - set(names))
        raise ValueError(f"kernel arguments: missing {missing}, unexpected {extra}")
    return KernelArgs(tuple(ctype for _, ctype in params), [values[name] for name in names])


def gemv_rows_bucket(rows: int) -> int | None:
    """The GEMV instantiation (MR) for `rows` decode rows: the smallest bucket >= rows; None
    when there are more rows than the largest (dequantize + cuBLAS instead)."""
    if rows < 1:
        raise ValueError(f"a GEMV launch needs at least one row, got {rows}")
    return next((b for b in GEMV_ROW_BUCKETS if b >= rows), None)


def quant_shape_problem(n: int, k: int, group_size: int) -> str | None:
    """Why the quantized-linear kernels cannot take a layer of this shape, or None if they can
    (a word of codes must not straddle a group, x rows must be 16-byte aligned)."""
    if n < 1 or k < 1:
        return f"empty layer ({n} x {k})"
    if k % QUANT_ALIGN or group_size % QUANT_ALIGN or k % group_size:
        return f"K = {k} and group size {group_size} must be multiples of {QUANT_ALIGN}, the group dividing K"
    return None


def quant_gemv_launch(n: int) -> LaunchConfig:
    """One CTA per QUANT_GEMV_COLS output columns (the last tile may be partial)."""
    return LaunchConfig(grid=(-(-n // QUANT_GEMV_COLS), 1, 1), block=(QUANT_GEMV_THREADS, 1, 1))


def quant_dequant_launch(n: int, k: int, bits: int) -> LaunchConfig:
    """One thread per 32-bit word of codes, DEQUANT_THREADS per CTA."""
    words = n * (k // codes_per_word(bits))
    return LaunchConfig(grid=(-(-words // DEQUANT_THREADS), 1, 1), block=(DEQUANT_THREADS, 1, 1))


def split_sum_index(values: int, lane: int, j: int = 0) -> int:
    """Which of a GEMV thread's `values` partial sums lane `lane` holds in slot `j` after
    quant_linear.cu's warp_split_sum (a mirror of the kernel comment, emulated in the tests)."""
    if values >= 32:
        return (values // 32) * lane + j
    return lane // (32 // values)
