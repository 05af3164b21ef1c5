"""Which kernels exist, how they are instantiated, and the launch geometry they assume.

Every kernel is a template over compile-time geometry; a model needs one instantiation of
each, chosen from its dtype, head_dim, block_size and GQA group size:

    program          source                 instantiations (name expressions)
    cache_ops        cache_ops.cu           write_kv_kernel<T>, copy_blocks_kernel
    decode           paged_attention.cu     paged_attention_kernel<T, HD, BS, GT>,
                                            paged_attention_reduce_kernel<T, HD>
    prefill          prefill_attention.cu   prefill_attention_kernel<T, HD, BS>  (fp16/bf16 only)
    quantized KV     cache_ops.cu           write_kv_quant_kernel<T, KV, HD>, copy_blocks_kernel
    (issue 31)       paged_attention.cu     paged_attention_quant_kernel<T, KV, HD, BS, GT>,
                                            paged_attention_reduce_kernel<T, HD>
                     prefill_attention.cu   prefill_attention_quant_kernel<T, KV, HD, BS>  (fp16/bf16)
    quant linear     quant_linear.cu        quant_gemv_kernel<T, S, BITS, MR> for MR in GEMV_ROW_BUCKETS,
                                            quant_dequant_kernel<T, S, BITS>

T in {float, f16, bf16}; KV (a quantized pool's code type) in {e4m3, e5m2, i8}; HD in HEAD_DIMS;
BS a power of two up to MAX_BLOCK_SIZE; GT (query
heads per CTA of the decode kernel) = next power of two >= num_heads / num_kv_heads, capped
at 8. fp32 prefill runs on the decode kernel (it is correct for any varlen batch).
Quantized checkpoints add one quant-linear program per (T, scale dtype S, bits) their layers
use (`quant_linear_program`): S is the checkpoint's scale dtype, kept exactly.

The constants mirrored from the .cu files (thread counts, prefill tiles) are the single
Python-side source for launch configurations and shared-memory sizes.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from pathlib import Path

KERNEL_DIR = Path(__file__).parent
HEADER_FILES = ("common.cuh", "mma.cuh", "kv_quant.cuh")

CXX_TYPES = {"float32": "float", "float16": "pkv::f16", "bfloat16": "pkv::bf16"}
# Quantized KV pools' code types (`--kv-cache-dtype`, issue 31; kernels/kv_quant.cuh).
KV_CODE_TYPES = {"fp8_e4m3": "pkv::e4m3", "fp8_e5m2": "pkv::e5m2", "int8": "pkv::i8"}
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
HEAD_DIMS = (16, 32, 64, 128, 256)
MAX_BLOCK_SIZE = 256
GROUP_TILES = (1, 2, 4, 8)

# Mirrors of the kernels' compile-time constants.
WRITE_KV_THREADS = 128
COPY_BLOCKS_THREADS = 256
DECODE_THREADS = 128  # kDecodeThreads
REDUCE_THREADS = 64  # kReduceThreads
PREFILL_THREADS = 128  # PrefillConfig::kThreads
PREFILL_BLOCK_M = 64  # PrefillConfig::kBlockM
QUANT_GEMV_THREADS = 128  # kQuantGemvThreads
QUANT_GEMV_COLS = 8  # kQuantGemvCols: output columns per GEMV CTA
DEQUANT_THREADS = 256  # kDequantThreads
QUANT_BITS = (4, 8)
# Row-count instantiations of the GEMV (MR): a call with r rows runs the smallest MR >= r, so
# the padding FMAs never exceed the real ones; more than the last runs dequantize + cuBLAS.
GEMV_ROW_BUCKETS = (1, 2, 4, 8)
# K and group_size must be multiples of this (QUANT_ALIGN): a code word never straddles a
# group, and x rows of 16-bit elements are 16-byte aligned (quant_linear.cu, its header).
QUANT_ALIGN = 8


@dataclass(frozen=True, slots=True)
class ProgramSpec:
    """One NVRTC program: a source file and the template instantiations to emit."""

    source: str
    name_expressions: tuple[str, ...]

    @property
    def label(self) -> str:
        return f"{self.source}[{', '.join(self.name_expressions)}]"


@dataclass(frozen=True, slots=True)
class AttentionGeometry:
    """The compile-time parameters of one model's kernels (plus the head counts they imply)."""

    dtype: str  # "float32" | "float16" | "bfloat16"
    head_dim: int
    block_size: int
    num_heads: int
    num_kv_heads: int
    kv_cache_dtype: str = "auto"  # or a quantized pool's format (KV_CODE_TYPES)

    def validate(self) -> None:
        if self.dtype not in CXX_TYPES:
            raise ValueError(f"unsupported KV dtype {self.dtype!r}; expected one of {', '.join(CXX_TYPES)}")
        if self.kv_cache_dtype != "auto" and self.kv_cache_dtype not in KV_CODE_TYPES:
            raise ValueError(
                f"unsupported kv_cache_dtype {self.kv_cache_dtype!r}; "
                f"expected auto or one of {', '.join(KV_CODE_TYPES)}"
            )
        if self.head_dim not in HEAD_DIMS:
            raise ValueError(f"unsupported head_dim {self.head_dim}; the CUDA kernels support {HEAD_DIMS}")
        bs = self.block_size
        if bs < 1 or bs > MAX_BLOCK_SIZE or bs & (bs - 1):
            raise ValueError(f"block_size must be a power of two in [1, {MAX_BLOCK_SIZE}], got {bs}")
        if self.num_kv_heads < 1 or self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads {self.num_heads} must be a positive multiple of num_kv_heads {self.num_kv_heads}"
            )

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def group_tile(self) -> int:
        return group_tile(self.group_size)

    @property
    def head_chunks(self) -> int:
        """Decode CTAs per kv head: ceil(group / GT)."""
        return -(-self.group_size // self.group_tile)


def group_tile(group_size: int) -> int:
    """Query heads per decode CTA: the next power of two >= the GQA group, at most 8."""
    tile = 1
    while tile < group_size and tile < GROUP_TILES[-1]:
        tile *= 2
    return tile


def cache_ops_program(dtype: str) -> ProgramSpec:
    return ProgramSpec(
        "cache_ops.cu", (f"pkv::write_kv_kernel<{CXX_TYPES[dtype]}>", "pkv::copy_blocks_kernel")
    )


def decode_program(dtype: str, head_dim: int, block_size: int, tile: int) -> ProgramSpec:
    t = CXX_TYPES[dtype]
    return ProgramSpec(
        "paged_attention.cu",
        (
            f"pkv::paged_attention_kernel<{t}, {head_dim}, {block_size}, {tile}>",
            f"pkv::paged_attention_reduce_kernel<{t}, {head_dim}>",
        ),
    )


def prefill_program(dtype: str, head_dim: int, block_size: int) -> ProgramSpec | None:
    """The tensor-core prefill kernel; None for fp32 (the decode kernel serves fp32 prefill)."""
    if dtype == "float32":
        return None
    t = CXX_TYPES[dtype]
    return ProgramSpec(
        "prefill_attention.cu", (f"pkv::prefill_attention_kernel<{t}, {head_dim}, {block_size}>",)
    )


def cache_ops_quant_program(dtype: str, kv_cache_dtype: str, head_dim: int) -> ProgramSpec:
    """The quantizing KV write (and the block copy, which copies bytes of any pool)."""
    t, kv = CXX_TYPES[dtype], KV_CODE_TYPES[kv_cache_dtype]
    return ProgramSpec(
        "cache_ops.cu", (f"pkv::write_kv_quant_kernel<{t}, {kv}, {head_dim}>", "pkv::copy_blocks_kernel")
    )


def decode_quant_program(
    dtype: str, kv_cache_dtype: str, head_dim: int, block_size: int, tile: int
) -> ProgramSpec:
    t, kv = CXX_TYPES[dtype], KV_CODE_TYPES[kv_cache_dtype]
    return ProgramSpec(
        "paged_attention.cu",
        (
            f"pkv::paged_attention_quant_kernel<{t}, {kv}, {head_dim}, {block_size}, {tile}>",
            f"pkv::paged_attention_reduce_kernel<{t}, {head_dim}>",
        ),
    )


def prefill_quant_program(
    dtype: str, kv_cache_dtype: str, head_dim: int, block_size: int
) -> ProgramSpec | None:
    if dtype == "float32":
        return None
    t, kv = CXX_TYPES[dtype], KV_CODE_TYPES[kv_cache_dtype]
    return ProgramSpec(
        "prefill_attention.cu", (f"pkv::prefill_attention_quant_kernel<{t}, {kv}, {head_dim}, {block_size}>",)
    )


def programs_for(geometry: AttentionGeometry) -> list[ProgramSpec]:
    """Every program a model with this geometry launches."""
    geometry.validate()
    g = geometry
    if g.kv_cache_dtype != "auto":
        specs = [
            cache_ops_quant_program(g.dtype, g.kv_cache_dtype, g.head_dim),
            decode_quant_program(g.dtype, g.kv_cache_dtype, g.head_dim, g.block_size, g.group_tile),
        ]
        prefill = prefill_quant_program(g.dtype, g.kv_cache_dtype, g.head_dim, g.block_size)
        return specs if prefill is None else [*specs, prefill]
    specs = [cache_ops_program(g.dtype), decode_program(g.dtype, g.head_dim, g.block_size, g.group_tile)]
    prefill = prefill_program(g.dtype, g.head_dim, g.block_size)
    return specs if prefill is None else [*specs, prefill]


# kernels/lora_sgmv.cu launch geometry (kShrinkWarps, kExpandThreads; a test reads the source).
LORA_SHRINK_WARPS = 4
LORA_EXPAND_THREADS = 128


def lora_program(dtype: str) -> ProgramSpec:
    """The multi-LoRA shrink and expand kernels for activations of `dtype` (issue 41)."""
    t = CXX_TYPES[dtype]
    return ProgramSpec("lora_sgmv.cu", (f"pkv::lora_shrink_kernel<{t}>", f"pkv::lora_expand_kernel<{t}>"))


def lora_grids(rows: int, max_rank: int, n: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """(shrink grid, expand grid) of one module's launch over `rows` rows (lora_sgmv.cu);
    blocks are LORA_SHRINK_WARPS * 32 and LORA_EXPAND_THREADS threads."""
    return (rows, -(-max_rank // LORA_SHRINK_WARPS)), (rows, -(-n // LORA_EXPAND_THREADS))


def codes_per_word(bits: int) -> int:
    return 32 // bits


@dataclass(frozen=True, slots=True)
class QuantLinearSpec:
    """The compile-time parameters of one family of quantized linear layers."""

    dtype: str  # activations and output: "float32" | "float16" | "bfloat16"
    scale_dtype: str  # the checkpoint's scales, kept exactly
    bits: int

    def validate(self) -> None:
        for field, value in (("dtype", self.dtype), ("scale dtype", self.scale_dtype)):
            if value not in CXX_TYPES:
                raise ValueError(
                    f"unsupported quantized-linear {field} {value!r}; expected one of {', '.join(CXX_TYPES)}"
                )
        if self.bits not in QUANT_BITS:
            raise ValueError(
                f"unsupported quantized-linear bits {self.bits}; the CUDA kernels support {QUANT_BITS}"
            )

    def template_args(self) -> str:
        return f"{CXX_TYPES[self.dtype]}, {CXX_TYPES[self.scale_dtype]}, {self.bits}"

    def gemv_expression(self, rows_bucket: int) -> str:
        if rows_bucket not in GEMV_ROW_BUCKETS:
            raise ValueError(f"GEMV row bucket {rows_bucket} is not one of {GEMV_ROW_BUCKETS}")
        return f"pkv::quant_gemv_kernel<{self.template_args()}, {rows_bucket}>"

    @property
    def dequant_expression(self) -> str:
        return f"pkv::quant_dequant_kernel<{self.template_args()}>"


def quant_linear_program(spec: QuantLinearSpec) -> ProgramSpec:
    """Every GEMV row bucket and the dequantize kernel of one (dtype, scale dtype, bits)."""
    spec.validate()
    names = tuple(spec.gemv_expression(r) for r in GEMV_ROW_BUCKETS) + (spec.dequant_expression,)
    return ProgramSpec("quant_linear.cu", names)


def quant_programs_for(specs) -> list[ProgramSpec]:
    """The programs a quantized model's layers launch (one per distinct spec, stable order)."""
    return [quant_linear_program(s) for s in dict.fromkeys(specs)]


def all_quant_linear_specs() -> list[QuantLinearSpec]:
    """Every instantiation the worker can ask for: each dtype x scale dtype x bits."""
    return [QuantLinearSpec(t, s, b) for t in CXX_TYPES for s in CXX_TYPES for b in QUANT_BITS]


def prefill_block_n(head_dim: int) -> int:
    return 64 if head_dim <= 128 else 32


def prefill_smem_bytes(dtype: str, head_dim: int) -> int:
    """Dynamic shared memory of prefill_attention_kernel: Q tile + 2 stages of K and V tiles,
    rows padded by 8 elements (PrefillConfig::kSmemElems * sizeof(T))."""
    stride = head_dim + 8
    return (PREFILL_BLOCK_M * stride + 4 * prefill_block_n(head_dim) * stride) * DTYPE_BYTES[dtype]


def decode_smem_bytes(partition_tokens: int, block_size: int) -> int:
    """Dynamic shared memory of paged_attention_kernel: the partition's block ids (int32)."""
    return 4 * (partition_tokens // block_size)


@cache
def read_sources() -> tuple[dict[str, str], dict[str, str]]:
    """(sources by file name, headers by include name), read once from the package."""
    sources = {p.name: p.read_text() for p in sorted(KERNEL_DIR.glob("*.cu"))}
    headers = {name: (KERNEL_DIR / name).read_text() for name in HEADER_FILES}
    return sources, headers
