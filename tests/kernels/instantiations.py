"""The kernel instantiations CI compiles: every geometry the worker's models use, plus a
sweep over dtypes, head dims, block sizes and GQA tiles.

Not the full cross product (3 dtypes x 5 head dims x 9 block sizes x 4 tiles): block size
only changes an index computation and is swept at one representative point; head dim and
GQA tile change register pressure and shared memory, so their extremes are covered for
every dtype.
"""

from __future__ import annotations

from kernels.specs import AttentionGeometry, ProgramSpec, lora_program, programs_for

ARCHS = ("sm_87", "sm_90")
DTYPES = ("float32", "float16", "bfloat16")

# Geometries of the models the worker serves and tests (worker/default_model.py presets,
# tests/worker/worker_test_utils.py tiny checkpoints as the GPU tests run them).
MODEL_GEOMETRIES = (
    AttentionGeometry("float32", 64, 16, 8, 2),  # embedded default model (Qwen3, GQA 4)
    AttentionGeometry("bfloat16", 64, 16, 14, 2),  # random:qwen2.5-0.5b (GQA 7 -> tile 8)
    AttentionGeometry("bfloat16", 128, 16, 16, 8),  # random:qwen3-0.6b (GQA 2)
    *(
        AttentionGeometry(dtype, hd, 4, 4, kv)
        for dtype in ("float32", "float16")
        for hd in (16, 32)
        for kv in (1, 2)
    ),
)


# Quantized KV pools (issue 31): each code type with the model geometries above, and int8 at
# the head-dim extremes (the write kernel's lanes, the decode kernel's registers).
QUANT_GEOMETRIES = tuple(
    AttentionGeometry(g.dtype, g.head_dim, g.block_size, g.num_heads, g.num_kv_heads, kv)
    for kv in ("fp8_e4m3", "fp8_e5m2", "int8")
    for g in (
        AttentionGeometry("float32", 64, 16, 8, 2),
        AttentionGeometry("bfloat16", 64, 16, 14, 2),
        AttentionGeometry("float16", 128, 16, 32, 4),
    )
) + (AttentionGeometry("float16", 256, 16, 8, 8, "int8"), AttentionGeometry("float32", 16, 4, 4, 1, "int8"))


def sweep_geometries() -> list[AttentionGeometry]:
    geometries = []
    for dtype in DTYPES:
        for head_dim in (64, 128, 256):
            geometries.append(AttentionGeometry(dtype, head_dim, 16, 8, 8))  # tile 1 (MHA)
            geometries.append(AttentionGeometry(dtype, head_dim, 16, 32, 4))  # tile 8 (GQA 8)
    for block_size in (8, 16, 32):
        geometries.append(AttentionGeometry("float16", 128, block_size, 32, 8))  # tile 4
    geometries.append(AttentionGeometry("float16", 128, 16, 16, 8))  # tile 2
    return geometries


def all_programs() -> list[ProgramSpec]:
    """Deduplicated programs over every geometry, in a stable order."""
    seen: dict[ProgramSpec, None] = {}
    for geometry in (*MODEL_GEOMETRIES, *sweep_geometries(), *QUANT_GEOMETRIES):
        for spec in programs_for(geometry):
            seen.setdefault(spec, None)
    for dtype in DTYPES:  # multi-LoRA (issue 41): compile-checked; the worker does not launch it yet
        seen.setdefault(lora_program(dtype), None)
    return list(seen)


def compile_into(job: tuple[ProgramSpec, str, str]):
    """Worker-process entry: compile one (program, arch) through a cubin cache directory."""
    from kernels.build import compile_program
    from kernels.cubin_cache import CubinCache

    spec, arch, cache_dir = job
    return spec, arch, compile_program(spec, arch, CubinCache(cache_dir))
