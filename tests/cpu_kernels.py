"""The fast CPU kernels in tests: skip with the reason where they cannot be built here, unless
PAGEDKV_REQUIRE_CPU_KERNELS=1 (set by .ci/run on a machine with a C compiler), which turns
that skip into a failure: a broken build must fail CI, not hide as skips."""

from __future__ import annotations

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


def variant_ops(tmp_dir: Path) -> dict[str, cpu_build.CpuOps]:
    """Every variant this CPU can run, loaded side by side (the prebuilt ones where their keys
    match, else built into tmp_dir), so each ISA's code path is tested on this machine."""
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
    return out


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
