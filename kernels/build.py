"""Compile-through-the-cache: the one entry point that turns a `ProgramSpec` into a cubin.

    spec + arch ──cache_key──▶ CubinCache.get ──hit──▶ CompiledProgram
                                    └─miss─▶ nvrtc.compile_source ─▶ CubinCache.put

No GPU is needed: CI calls this for sm_87 and sm_90; the CUDA loader (kernels.driver) calls
it for the arch of the device it found. Only the NVRTC version enters the key (not the
driver's), because the cubin depends on the compiler alone; whether a driver can load it is
checked by kernels.driver before anything is compiled.
"""

from __future__ import annotations

from collections.abc import Sequence

from kernels.cubin_cache import CubinCache, cache_key
from kernels.nvrtc import BASE_OPTIONS, CompiledProgram, compile_source, normalize_arch, nvrtc_version
from kernels.specs import ProgramSpec, read_sources

# Extra NVRTC options for every program. Kept empty: NVRTC optimises by default, and fast
# math is not needed (the kernels already use ex2.approx where it is intended).
PROGRAM_OPTIONS: tuple[str, ...] = ()


def compile_program(
    spec: ProgramSpec,
    arch: str,
    cache: CubinCache | None = None,
    options: Sequence[str] = PROGRAM_OPTIONS,
) -> CompiledProgram:
    """The cubin of `spec` for `arch`, from the cache when present (compiled and stored if not)."""
    arch = normalize_arch(arch)
    sources, headers = read_sources()
    source = sources[spec.source]
    version = nvrtc_version()
    # The key covers every option NVRTC sees (its fixed base options too): changing either
    # one must miss the cache, not load a cubin built another way.
    key = cache_key(
        spec.source, source, headers, spec.name_expressions, arch, (*BASE_OPTIONS, *options), version
    )
    if cache is not None:
        cached = cache.get(key)
        if cached is not None:
            return cached
    program = compile_source(spec.source, source, headers, spec.name_expressions, arch, options)
    if cache is not None:
        description = {
            "source": spec.source,
            "name_expressions": list(spec.name_expressions),
            "arch": arch,
            "options": list(options),
            "nvrtc": f"{version[0]}.{version[1]}",
        }
        cache.put(key, program, description)
    return program
