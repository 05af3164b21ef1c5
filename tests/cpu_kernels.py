"""The fast CPU kernels in tests: skip with the reason where they cannot be built here, unless
PAGEDKV_REQUIRE_CPU_KERNELS=1 (set by .ci/run on a machine with a C compiler), which turns
that skip into a failure: a broken build must fail CI, not hide as skips."""

from __future__ import annotations

import functools
import os
from pathlib import Path

import pytest

from kernels import cpu_build, cpu_variants

REQUIRE_ENV = "PAGEDKV_REQUIRE_CPU_KERNELS"


def unavailable(reason: str):
    """Skip (or, where the kernels are required, fail) the calling test, saying why."""
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"the fast CPU kernels are required here ({REQUIRE_ENV}=1) but unavailable: {reason}")
    pytest.skip(f"fast CPU kernels unavailable here: {reason}")


def load_ops() -> cpu_build.CpuOps:
    try:
        return cpu_build.load_cpu_ops()
    except cpu_build.CpuKernelBuildError as exc:
        unavailable(str(exc))


AMX = "avx512amx"
EMULATED_ORIGIN = "test: every tile instruction emulated in software (kernels/cpu_amx_emulate.h)"


def machine_runs_amx() -> bool:
    """This CPU and kernel run the avx512amx variant itself (else tests may emulate it)."""
    return AMX in {v.name for v in cpu_variants.usable_variants()}


def variant_ops(tmp_dir: Path) -> dict[str, cpu_build.CpuOps]:
    """Every variant this CPU can run, loaded side by side (the prebuilt ones where their keys
    match, else built into tmp_dir), so each ISA's code path is tested on this machine. Where
    the CPU (or its kernel) runs no AMX tiles but the avx512amx variant's AVX-512 code, "avx512amx"
    is the emulated build (its origin says so): the tile kernels' layout math is tested anyway."""
    out = {}
    cc = cpu_build.compiler_command()
    for variant in cpu_variants.usable_variants():
        path = cpu_build.PREBUILT_DIR / f"{variant.name}.so"
        if not cpu_build.key_matches(path, variant, None):
            if cc is None:
                continue
            path = cpu_build.compile_variant(variant, tmp_dir / f"{variant.name}.so", cc)
        out[variant.name] = cpu_build.CpuOps(path, variant.name, "test")
    if not out:
        unavailable("no variant could be loaded or built")
    emulated = None if AMX in out else emulated_amx_ops()
    if emulated is not None:
        out[AMX] = emulated
    return out


def emulated_amx_library(cc: list[str] | None) -> Path | None:
    """The AMX_EMULATED build (make setup prebuilds it; else found in or built into the kernel
    cache), or None where this CPU cannot run its AVX-512 code or none can be had."""
    variant = cpu_variants.AMX_EMULATED
    if not variant.requires <= cpu_variants.cpu_features():
        return None
    path = cpu_build.PREBUILT_DIR / f"{variant.name}.so"
    if cpu_build.key_matches(path, variant, None):
        return path
    return None if cc is None else cpu_build.build_in_cache(variant, cc)[0]


@functools.cache
def emulated_amx_ops() -> cpu_build.CpuOps | None:
    """The AMX_EMULATED build loaded as "avx512amx" (its origin says emulated), once per process,
    for tests standing it in for the tiles this CPU lacks (the pytest summary then says so);
    None where it cannot be built or run here."""
    library = emulated_amx_library(cpu_build.compiler_command())
    return None if library is None else cpu_build.CpuOps(library, AMX, EMULATED_ORIGIN)


def emulation_note() -> str | None:
    """Why the AMX tests ran on the emulated tiles, once a test stood them in; else None."""
    if not emulated_amx_ops.cache_info().currsize or emulated_amx_ops() is None:
        return None
    return "; ".join(cpu_variants.choose_variants()[1]) or f"this CPU does not run the {AMX} variant"


def unoptimized(launcher: Path, compiler: str, log: Path | None = None) -> str:
    """A CC command (a launcher script, as ccache is one) that runs `compiler` with -O0 last,
    so it wins over the variant's -O2: a variant builds in ~8-10 s instead of ~25-30 s on
    2 cores. The tests using it check where a library goes, its key and what loads it, not the
    code gcc makes (the kernel tests run make setup's optimized libraries). `log`: each
    command line, as the launcher received it, appended there."""
    record = f'echo "$@" >> {log}\n' if log else ""
    launcher.write_text(f'#!/bin/sh\n{record}exec "$@" -O0\n')
    launcher.chmod(0o755)
    return f"{launcher} {compiler}"
