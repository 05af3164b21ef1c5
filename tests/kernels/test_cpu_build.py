"""Building and picking the fast CPU kernels (kernels/cpu_build.py): a library is loaded only when
its key file matches, the variant follows the running CPU's features (never the build host's),
and every way a build can fail (no compiler, an unwritable cache, a wrapper $CC, clang without
OpenMP) either works or raises CpuKernelBuildError saying why."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import stat
from pathlib import Path

import pytest
import torch

from kernels import cpu_build, cpu_variants
from kernels.cpu_build import CpuKernelBuildError
from tests.cpu_kernels import unoptimized
from worker.cpu_weights import PanelLinear

GENERIC = next(v for v in cpu_variants.machine_variants() if v.name == "generic")


@pytest.fixture
def cc():
    found = cpu_build.compiler_command()
    if found is None:
        pytest.skip("no C compiler on this machine: the build tests need one (the fallback tests do not)")
    return found


@pytest.fixture(scope="module")
def prebuilt(tmp_path_factory):
    """The module's one gcc build: make setup's `prebuild` of a variant the compiler refuses and
    the generic one (unoptimized: see tests.cpu_kernels.unoptimized). Returns (built names,
    what it printed, generic.so)."""
    cc = cpu_build.compiler_command()
    if cc is None:
        pytest.skip("no C compiler on this machine")
    out = tmp_path_factory.mktemp("prebuilt")
    refused = cpu_variants.Variant("refused", ("-mno-such-option-anywhere",), frozenset())
    printed = io.StringIO()
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stderr(printed):
        mp.setenv("CC", unoptimized(out.parent / "launch-O0", cc[0]))
        built = cpu_build.prebuild(out, variants=[refused, GENERIC])
    return built, printed.getvalue(), out / "generic.so"


@pytest.fixture(scope="module")
def generic_lib(prebuilt):
    return prebuilt[2]


def test_a_build_writes_a_key_and_a_readable_library(generic_lib):
    key = json.loads(generic_lib.with_suffix(".json").read_text())
    assert key["variant"] == "generic" and key["sources"] == cpu_build.source_digest()
    assert key["flags"][: len(cpu_build.BASE_OPTIONS)] == list(cpu_build.BASE_OPTIONS)
    mode = generic_lib.stat().st_mode
    assert mode & stat.S_IROTH and mode & stat.S_IXOTH  # an image's service user can load it
    assert cpu_build.key_matches(generic_lib, GENERIC, None)
    assert list(generic_lib.parent.glob("*.tmp")) == []


def test_a_library_is_not_trusted_by_its_name(generic_lib, tmp_path):
    copy = tmp_path / "generic.so"
    shutil.copy(generic_lib, copy)
    assert not cpu_build.key_matches(copy, GENERIC, None)  # no key file
    key = json.loads(generic_lib.with_suffix(".json").read_text())
    for field, value in [("sources", "0" * 64), ("flags", ["-O0"]), ("variant", "avx2"), ("version", 0)]:
        copy.with_suffix(".json").write_text(json.dumps({**key, field: value}))
        assert not cpu_build.key_matches(copy, GENERIC, None), field
    copy.with_suffix(".json").write_text(json.dumps(key))
    assert cpu_build.key_matches(copy, GENERIC, None)
    assert not cpu_build.key_matches(copy, GENERIC, "another compiler 99")  # a start-time build's check
    copy.with_suffix(".json").write_text("{not json")
    assert not cpu_build.key_matches(copy, GENERIC, None)


@pytest.fixture
def amx_probe(monkeypatch):
    """The AMX permission probe played by a test: set `.answer` to None (granted) or a reason."""

    class Probe:
        answer: str | None = None
        calls = 0

        def __call__(self):
            self.calls += 1
            return self.answer

    probe = Probe()
    monkeypatch.setitem(cpu_variants.RUNTIME_PROBES, "amx", probe)
    monkeypatch.setattr(cpu_variants.platform, "machine", lambda: "x86_64")
    monkeypatch.delenv(cpu_variants.VARIANT_ENV, raising=False)
    return probe


X86 = {v.name: v for v in cpu_variants.VARIANTS["x86_64"]}
AMX_FLAGS = X86["avx512amx"].requires


def test_amx_is_chosen_when_the_flags_are_there_and_the_kernel_grants_the_tiles(amx_probe):
    variants, notes = cpu_variants.choose_variants(AMX_FLAGS)
    assert [v.name for v in variants][:2] == ["avx512amx", "avx512bf16"] and notes == []
    assert amx_probe.calls == 1


def test_a_refused_tile_permission_falls_back_with_the_reason(amx_probe):
    amx_probe.answer = (
        "the kernel refused the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM: Invalid argument)"
    )
    variants, notes = cpu_variants.choose_variants(AMX_FLAGS)
    assert variants[0].name == "avx512bf16"
    assert notes == [f"avx512amx not used: {amx_probe.answer}"]


def test_missing_amx_flags_fall_back_without_asking_the_kernel(amx_probe):
    without = AMX_FLAGS - {"amx_tile"}
    variants, notes = cpu_variants.choose_variants(without)
    assert variants[0].name == "avx512bf16" and amx_probe.calls == 0
    assert notes == ["avx512amx not used: needs CPU features this CPU lacks: amx_tile"]
    # an AMD EPYC's flags (AVX-512 BF16, no AMX): the same fallback, the same kind of note
    epyc = X86["avx512bf16"].requires
    variants, notes = cpu_variants.choose_variants(epyc)
    assert variants[0].name == "avx512bf16" and "amx_bf16, amx_int8, amx_tile" in notes[0]


def test_a_forced_amx_variant_is_probed_too(amx_probe, monkeypatch):
    monkeypatch.setenv(cpu_variants.VARIANT_ENV, "avx512amx")
    assert [v.name for v in cpu_variants.usable_variants(AMX_FLAGS)] == ["avx512amx"]
    amx_probe.answer = "refused by a seccomp filter"
    with pytest.raises(
        CpuKernelBuildError, match="PAGEDKV_CPU_VARIANT=avx512amx refused by a seccomp filter"
    ):
        cpu_variants.usable_variants(AMX_FLAGS)
    monkeypatch.setenv(cpu_variants.VARIANT_ENV, "avx512bf16")  # forcing the older variant skips the probe
    amx_probe.calls = 0
    assert [v.name for v in cpu_variants.usable_variants(AMX_FLAGS)] == ["avx512bf16"]
    assert amx_probe.calls == 0


def test_the_reason_amx_was_passed_over_reaches_the_origin(amx_probe, monkeypatch, tmp_path):
    """What forward_kernels and the ready line print: "avx512bf16 (prebuilt; avx512amx not used: ...)"."""
    amx_probe.answer = "refused"
    monkeypatch.setattr(cpu_variants, "cpu_features", lambda: AMX_FLAGS)
    monkeypatch.setattr(cpu_build, "key_matches", lambda path, variant, _: variant.name == "avx512bf16")
    path, variant, origin = cpu_build.find_or_build(tmp_path / "cache", tmp_path / "prebuilt")
    assert (variant.name, origin) == ("avx512bf16", "prebuilt; avx512amx not used: refused")


TILE_RUN = """
import ctypes, sys
from kernels import cpu_build, cpu_variants
if sys.argv[2] == "ask":
    assert cpu_variants.amx_tile_permission() is None
lib = ctypes.CDLL(sys.argv[1])
x, y = (ctypes.c_float * (16 * 32))(*[1.0] * 512), (ctypes.c_float * (16 * 64))()
w = (ctypes.c_uint16 * (64 * 32))()
lib.pk_linear.argtypes = cpu_build.SIGNATURES["pk_linear"][1]
w[0] = 0x3F80  # W[0][0] = 1.0 in bf16
assert lib.pk_linear(1, y, 64, x, 32, w, None, 16, 64, 32, 32, 1) == 0 and y[0] == 1.0 and y[64] == 1.0
"""


def test_the_tiles_need_the_kernels_permission_and_the_probe_gets_it(tmp_path):
    """On an AMX CPU whose kernel grants the tile state: the same 16-row bf16 linear dies of SIGILL
    in a process that did not ask, and runs in one that did (so the probe is both needed and
    enough). Elsewhere the probe's refusal is a reason, never an exception."""
    import signal
    import subprocess
    import sys

    answer = cpu_variants.amx_tile_permission()
    if not {"amx_tile", "amx_bf16"} <= cpu_variants.cpu_features() or answer is not None:
        assert answer is None or isinstance(answer, str)
        pytest.skip(f"no AMX tiles to run here: {answer or 'the CPU lacks the amx_tile/amx_bf16 flags'}")
    variant = X86["avx512amx"]
    lib = cpu_build.PREBUILT_DIR / "avx512amx.so"
    if not cpu_build.key_matches(lib, variant, None):
        cc = cpu_build.compiler_command() or pytest.skip("no prebuilt avx512amx kernels and no compiler")
        lib = cpu_build.compile_variant(variant, tmp_path / "avx512amx.so", cc)
    env = {**os.environ, "PYTHONPATH": str(cpu_build.HERE.parent)}
    runs = {
        mode: subprocess.run([sys.executable, "-c", TILE_RUN, str(lib), mode], env=env, capture_output=True,
                             text=True, timeout=120)
        for mode in ("ask", "skip")
    }  # fmt: skip
    assert runs["ask"].returncode == 0, runs["ask"].stderr
    assert runs["skip"].returncode == -signal.SIGILL, runs["skip"].stderr


def test_variants_follow_the_running_cpu(monkeypatch):
    monkeypatch.delenv(cpu_variants.VARIANT_ENV, raising=False)
    monkeypatch.setitem(cpu_variants.RUNTIME_PROBES, "amx", lambda: None)  # flags decide here, not the kernel
    names = [v.name for v in cpu_variants.machine_variants()]
    assert [v.name for v in cpu_variants.usable_variants(frozenset())] == ["generic"]
    everything = frozenset().union(*(v.requires for v in cpu_variants.machine_variants()))
    assert [v.name for v in cpu_variants.usable_variants(everything)] == names  # best first
    if "avx2" in names:
        avx2_only = next(v for v in cpu_variants.VARIANTS["x86_64"] if v.name == "avx2").requires
        assert [v.name for v in cpu_variants.usable_variants(avx2_only)] == ["avx2", "generic"]


def test_a_forced_variant_is_checked_against_the_cpu(monkeypatch):
    monkeypatch.setenv(cpu_variants.VARIANT_ENV, "generic")
    assert [v.name for v in cpu_variants.usable_variants(frozenset())] == ["generic"]
    best = cpu_variants.machine_variants()[0]
    if best.requires:
        monkeypatch.setenv(cpu_variants.VARIANT_ENV, best.name)
        with pytest.raises(CpuKernelBuildError, match="needs CPU features this CPU lacks"):
            cpu_variants.usable_variants(frozenset())
    monkeypatch.setenv(cpu_variants.VARIANT_ENV, "sparc")
    with pytest.raises(CpuKernelBuildError, match="not a variant of this machine"):
        cpu_variants.usable_variants(frozenset())


def test_prebuilt_wins_then_a_start_time_build_then_the_cache(monkeypatch, tmp_path, generic_lib, cc):
    """The start-time build runs through CC="launcher gcc -m64": a launcher (standing in for
    ccache), a compiler and a flag are a command, not a file name."""
    monkeypatch.setenv(cpu_variants.VARIANT_ENV, "generic")
    calls = tmp_path / "launch.log"
    flag = "-m64" if os.uname().machine == "x86_64" else "-O2"
    monkeypatch.setenv("CC", f"{unoptimized(tmp_path / 'launch', cc[0], calls)} {flag}")
    prebuilt, cache = tmp_path / "prebuilt", tmp_path / "cache"
    prebuilt.mkdir()
    for suffix in (".so", ".json"):
        shutil.copy(generic_lib.with_suffix(suffix), prebuilt / f"generic{suffix}")
    assert cpu_build.find_or_build(cache, prebuilt)[2] == "prebuilt"
    (prebuilt / "generic.json").unlink()  # a prebuilt library without a key is ignored
    path, variant, origin = cpu_build.find_or_build(cache, prebuilt)
    assert (origin, variant.name, path.parent) == ("built at start", "generic", cache)
    assert any(line.startswith(f"{cc[0]} {flag} ") and "cpu_attention.c" in line
               for line in calls.read_text().splitlines())  # fmt: skip
    assert cpu_build.CpuOps(path, "generic", origin).pk_linear is not None
    stamp = path.stat().st_mtime_ns
    again = cpu_build.find_or_build(cache, prebuilt)
    assert again[0] == path and again[2] == "cache" and path.stat().st_mtime_ns == stamp


def test_no_prebuilt_and_no_compiler_says_so(monkeypatch, tmp_path):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    with pytest.raises(CpuKernelBuildError, match="no prebuilt library for these sources, and no C compiler"):
        cpu_build.find_or_build(tmp_path / "cache", tmp_path / "empty")


def test_an_unwritable_cache_is_a_reason_not_a_traceback(monkeypatch, tmp_path, cc):
    monkeypatch.setenv(cpu_variants.VARIANT_ENV, "generic")
    blocker = tmp_path / "file"
    blocker.write_text("a file where the cache directory should be")
    with pytest.raises(CpuKernelBuildError, match="cannot write CPU kernels to"):
        cpu_build.find_or_build(blocker / "kernels", tmp_path / "empty")


def test_clang_builds_the_same_kernels(tmp_path):
    """The sources are not GCC-only: clang builds them (single-threaded where it has no OpenMP
    runtime) and the linear kernel gives GCC's results."""
    clang = shutil.which("clang")
    if clang is None:
        pytest.skip("clang is not installed (.ci/run installs it where apt can)")
    variant = cpu_variants.usable_variants()[0]
    path = cpu_build.compile_variant(variant, tmp_path / f"{variant.name}.so", [clang])
    ops = cpu_build.CpuOps(path, variant.name, "test")
    weight, x = torch.randn(100, 64).to(torch.bfloat16), torch.randn(3, 64)
    got = PanelLinear(ops, weight, None, torch.bfloat16)(x)
    gcc_ops = cpu_build.load_cpu_ops() if cpu_build.load_cpu_ops().variant == variant.name else None
    if gcc_ops is not None:
        want = PanelLinear(gcc_ops, weight, None, torch.bfloat16)(x)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-5)
    assert ("single-threaded" in ops.origin) == cpu_build.is_serial(path)


def test_prebuild_skips_a_variant_the_compiler_refuses(prebuilt):
    """What make setup and pip install run: one variant failing is a message, not a failed install."""
    built, printed, generic = prebuilt
    assert built == ["generic"]
    assert "refused not prebuilt" in printed
    assert cpu_build.key_matches(generic, GENERIC, None)


def test_prebuild_variants_can_be_named(monkeypatch, tmp_path):
    monkeypatch.setenv(cpu_build.PREBUILD_ENV, "sparc")
    with pytest.raises(CpuKernelBuildError, match="PAGEDKV_PREBUILD_VARIANTS names sparc, not variants"):
        cpu_build.prebuild(tmp_path)
    monkeypatch.setenv(cpu_build.PREBUILD_ENV, "generic")
    monkeypatch.setattr(cpu_build, "compile_variant", lambda variant, out, *_: out)
    assert cpu_build.prebuild(tmp_path) == ["generic"]


def test_the_installed_prebuilt_kernels_are_current():
    """make setup prebuilt kernels for this tree; stale ones would silently cost a start-time
    build (or, on a compiler-less image, the fast path)."""
    variant = cpu_variants.usable_variants()[0]
    path = cpu_build.PREBUILT_DIR / f"{variant.name}.so"
    if not path.exists() and cpu_build.compiler_command() is None:
        pytest.skip("no prebuilt kernels and no compiler here")
    assert cpu_build.key_matches(path, variant, None), f"{path} is missing or stale: run make setup"


def test_sources_are_in_the_key():
    assert set(cpu_build.SOURCES) | set(cpu_build.HEADERS) <= {p.name for p in Path(cpu_build.HERE).iterdir()}
