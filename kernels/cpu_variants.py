"""Which build of the C kernels this CPU runs: the ISA variants of each architecture (best first,
each compiled for an ISA level and never `-march=native`), the checks the CPU's flags cannot
answer (the kernel's grant of the AMX tile state), and the choice at start, which
`PAGEDKV_CPU_VARIANT=name` forces. A variant this process cannot run is passed over with its
reason, never a failed start. Stdlib only: setup.py imports kernels.cpu_build, which imports this.
"""

from __future__ import annotations

import ctypes
import os
import platform
import sys
from dataclasses import dataclass
from pathlib import Path


class CpuKernelBuildError(RuntimeError):
    """The kernels cannot be built or loaded here; the message says why."""


VARIANT_ENV = "PAGEDKV_CPU_VARIANT"


@dataclass(frozen=True)
class Variant:
    name: str
    flags: tuple[str, ...]
    requires: frozenset[str]  # /proc/cpuinfo flags (x86) or Features (arm) the CPU must have
    probe: str = ""  # a RUNTIME_PROBES check this process must also pass (flags are not enough)


_V3 = {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "movbe", "xsave"}
_V4 = _V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
_BF16 = ("-march=x86-64-v4", "-mavx512bf16", "-mavx512vnni", "-mtune=generic")
VARIANTS = {
    "x86_64": (
        # AMX tiles for bf16 GEMMs and GGUF block linears of 4+ rows (cpu_gemm_amx.c,
        # cpu_gguf_amx.c) and prefill attention; everything else as avx512bf16.
        Variant(
            "avx512amx",
            (*_BF16, "-mamx-tile", "-mamx-bf16", "-mamx-int8"),
            frozenset(_V4 | {"avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16", "amx_int8"}),
            probe="amx",
        ),
        Variant(
            "avx512bf16",
            _BF16,
            frozenset(_V4 | {"avx512_bf16", "avx512_vnni"}),
        ),
        Variant(
            "avx512vnni",
            ("-march=x86-64-v4", "-mavx512vnni", "-mtune=generic"),
            frozenset(_V4 | {"avx512_vnni"}),
        ),
        Variant("avx512", ("-march=x86-64-v4", "-mtune=generic"), frozenset(_V4)),
        Variant("avx2", ("-march=x86-64-v3", "-mtune=generic"), frozenset(_V3)),
        Variant("generic", ("-march=x86-64", "-mtune=generic"), frozenset()),
    ),
    # Orin's Cortex-A78AE: ARMv8.2 with half-precision arithmetic (fphp/asimdhp).
    "aarch64": (
        Variant("neon-fp16", ("-march=armv8.2-a+fp16",), frozenset({"asimd", "fphp", "asimdhp"})),
        Variant("generic", ("-march=armv8-a",), frozenset()),
    ),
}
GENERIC = (Variant("generic", (), frozenset()),)  # any other machine: the compiler's default target

# Tests only, never chosen at start: avx512amx's kernels with every tile instruction run in
# software (kernels/cpu_amx_emulate.h), so the tile kernels' layouts, strides and clipping are
# tested on CPUs without AMX (slow; it shows nothing of the tiles' speed). It needs what the
# avx512amx variant's AVX-512 code needs.
AMX_EMULATED = Variant(
    "avx512amx-emulated",
    (*_BF16, "-DPK_AMX_EMULATE"),
    frozenset(_V4 | {"avx512_bf16", "avx512_vnni"}),
)


# -- checks beyond the CPU's flags --------------------------------------------------------------
ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA, SYS_ARCH_PRCTL_X86_64 = 0x1023, 18, 158


def amx_tile_permission() -> str | None:
    """None once Linux lets this process use the AMX tile registers, else why not.

    The tile data (8 KiB a thread) is off until the process asks: arch_prctl(ARCH_REQ_XCOMP_PERM,
    XFEATURE_XTILEDATA). The grant covers every thread of the process, present and future (the
    OpenMP pool included), so asking once here, in the process that loads and runs the kernels,
    before any tile instruction, is enough; without it the first tile instruction is SIGILL. A
    kernel before 5.16, a hypervisor that hides the state, or a seccomp filter refuses."""
    if sys.platform != "linux" or platform.machine().lower() not in ("x86_64", "amd64"):
        return "AMX tile permission is a Linux x86-64 request"
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        rc = libc.syscall(ctypes.c_long(SYS_ARCH_PRCTL_X86_64), ctypes.c_long(ARCH_REQ_XCOMP_PERM),
                          ctypes.c_long(XFEATURE_XTILEDATA))  # fmt: skip
    except (OSError, AttributeError) as exc:
        return f"cannot ask the kernel for the AMX tile state: {exc}"
    if rc != 0:
        err = ctypes.get_errno()
        return f"the kernel refused the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM: {os.strerror(err)})"
    return None


# Variant.probe -> check (None: pass; a string: why this process cannot run the variant). Tests
# replace entries to play a CPU or kernel that grants or refuses.
RUNTIME_PROBES = {"amx": amx_tile_permission}


def machine_variants() -> tuple[Variant, ...]:
    machine = platform.machine().lower()
    return VARIANTS.get({"amd64": "x86_64", "arm64": "aarch64"}.get(machine, machine), GENERIC)


def cpu_features() -> frozenset[str]:
    """This CPU's feature flags, as /proc/cpuinfo names them (empty where it cannot be read)."""
    try:
        return features_in(Path("/proc/cpuinfo").read_text())
    except OSError:
        return frozenset()


def features_in(cpuinfo: str) -> frozenset[str]:
    """The first processor's flags (x86) or Features (arm) in /proc/cpuinfo's text."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


# -- at start ----------------------------------------------------------------------------------------
def _refusal(variant: Variant, features: frozenset[str]) -> str | None:
    """Why this process cannot run `variant` (missing flags, then its runtime probe), or None."""
    missing = ", ".join(sorted(variant.requires - features))
    if missing:
        return f"needs CPU features this CPU lacks: {missing}"
    return RUNTIME_PROBES[variant.probe]() if variant.probe else None


def choose_variants(features: frozenset[str] | None = None) -> tuple[list[Variant], list[str]]:
    """(this process's variants, best first; why each probed variant better than the first was
    passed over). One variant only if PAGEDKV_CPU_VARIANT names it, and an error if it cannot run.
    The notes name only variants with a probe (the matrix engines): the flags of the others are
    what /proc/cpuinfo already says, the probe's answer is not."""
    features = cpu_features() if features is None else features
    variants = machine_variants()
    forced = os.environ.get(VARIANT_ENV)
    if forced:
        named = [v for v in variants if v.name == forced]
        if not named:
            names = ", ".join(v.name for v in variants)
            raise CpuKernelBuildError(f"{VARIANT_ENV}={forced} is not a variant of this machine ({names})")
        reason = _refusal(named[0], features)
        if reason:
            raise CpuKernelBuildError(f"{VARIANT_ENV}={forced} {reason}")
        return named, []
    usable, notes = [], []
    for variant in variants:
        reason = _refusal(variant, features)
        if reason is None:
            usable.append(variant)
        elif variant.probe and not usable:
            notes.append(f"{variant.name} not used: {reason}")
    return usable, notes


def usable_variants(features: frozenset[str] | None = None) -> list[Variant]:
    """This CPU's variants, best first (one only if PAGEDKV_CPU_VARIANT names it)."""
    return choose_variants(features)[0]
