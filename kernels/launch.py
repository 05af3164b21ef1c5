"""Launch geometry and kernel-argument packing: pure Python, no GPU, tested in CI.

Everything a launch needs besides device pointers is decided here, from shapes and fixed
limits only, so that the CUDA backend stays a thin layer and CUDA-graph safety can be
checked without a device:

  - `plan_decode` picks single-pass or split-K for the decode kernel. It sees only the row
    count and an upper bound of the context (`max_seq_len`); the CUDA-graph runner passes the
    buffer capacity (max_model_len) there, so grid and shared memory are the same on every
    replay and the kernels skip partitions past each row's real context.
  - `prefill_grid` sizes the tensor-core prefill launch.
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
    PREFILL_BLOCK_M,
    PREFILL_THREADS,
    REDUCE_THREADS,
    WRITE_KV_THREADS,
    decode_smem_bytes,
)

# Keys per split-K partition. A multiple of every supported block size (<= 256), so each
# partition starts on a block boundary as the decode kernel requires.
PARTITION_TOKENS = 512
# Split-K is used when the unsplit grid has fewer CTAs than this many per SM.
TARGET_CTAS_PER_SM = 2
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
) -> DecodePlan:
    """Choose single-pass or split-K from shapes only (never from per-row lengths).

    Split when the context is longer than one partition and either the unsplit grid would
    leave SMs idle (few rows: small batches, long contexts) or the unsplit launch would need
    more dynamic shared memory (block ids of the whole context) than the kernel may use.
    """
    if rows < 1 or ctas_per_row < 1:
        raise ValueError(f"decode launch needs rows >= 1 and ctas_per_row >= 1, got {rows}, {ctas_per_row}")
    single_tokens = round_up(max(max_seq_len, 1), block_size)
    fits = decode_smem_bytes(single_tokens, block_size) <= dynamic_smem_limit
    few_ctas = rows * ctas_per_row < TARGET_CTAS_PER_SM * num_sms
    if max_seq_len <= PARTITION_TOKENS or (fits and not few_ctas):
        return DecodePlan(rows, ctas_per_row, 1, single_tokens, block_size)
    num_partitions = -(-max_seq_len // PARTITION_TOKENS)
    return DecodePlan(rows, ctas_per_row, num_partitions, PARTITION_TOKENS, block_size)


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
