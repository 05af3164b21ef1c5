"""The fast CPU forward's C kernels: built ahead of time per ISA variant, picked at run time by the
CPU's features, JIT-built only where no prebuilt library fits, and never able to break a start.

    kernels/cpu_*.c ── cc -O3 -march=<variant> -fopenmp -shared ──▶ <variant>.so + <variant>.json
       at install:  `make setup` / `pip install .` ─▶ kernels/prebuilt/         (no compiler at run time)
       at start:    only when no prebuilt fits     ─▶ $PAGEDKV_CACHE_DIR/kernels/

Variants (best first) are compiled for an ISA level, never `-march=native`, so a library built on
one host runs on any CPU with that level's features, and the choice is made by the CPU that runs
it (`/proc/cpuinfo`), not the one that built it. `PAGEDKV_CPU_VARIANT=name` forces one. The
variants, their probes and the choice: kernels/cpu_variants.py.

A library is loaded only if its key file (<name>.json) matches: the source hash of every C file
and header, the compiler flags, and (for a start-time build) the compiler's identity; and only
if this CPU has the variant's features. File names alone are never trusted.

Every failure (no compiler, a compiler that rejects a flag, an unwritable cache directory, a
wrapper `CC` such as "ccache gcc" or "gcc -m64" is parsed, not failed) raises CpuKernelBuildError
saying why, and the worker serves with the reference forward unless told `--cpu-kernels fast`.
The library must be loaded after torch: its libgomp then resolves (by SONAME) to torch's copy, so
the kernels and torch's ops share one OpenMP thread pool. Stdlib only: setup.py imports this.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from pathlib import Path

from kernels.cache_dir import default_cache_dir
from kernels.cpu_variants import (
    AMX_EMULATED,
    CpuKernelBuildError,
    Variant,
    choose_variants,
    cpu_features,
    machine_variants,
)

HERE = Path(__file__).resolve().parent
# Translation units, the slowest first: they compile in parallel (one compiler per core), then link.
SOURCES = (
    "cpu_attention_decode_quant.c",
    "cpu_attention_decode.c",
    "cpu_attention_prefill.c",
    "cpu_attention_amx.c",
    "cpu_attention_decode_amx.c",
    "cpu_gemm_tiles.c",
    "cpu_gemm.c",
    "cpu_gemm_amx.c",
    "cpu_ops.c",
    "cpu_quant.c",
    "cpu_quant_amx.c",
    "cpu_quant_int8.c",
    "cpu_gguf.c",
    "cpu_gguf_amx.c",
    "cpu_gguf_panels.c",
    "cpu_gguf_vnni.c",
    "cpu_gguf_strip.c",
    "cpu_sampling.c",
    "cpu_decoder.c",
    "cpu_attention.c",
    "cpu_lora.c",
    "cpu_shm.c",
    "cpu_panel_share.c",
    "cpu_amx_emulate.c",
)
HEADERS = (
    "cpu_amx.h",
    "cpu_amx_emulate.h",
    "cpu_gemm.h",
    "cpu_panel_share.h",
    "cpu_gemm_tiles.h",
    "cpu_lane_argmax.h",
    "cpu_gemm_amx.h",
    "cpu_simd.h",
    "cpu_kv_quant.h",
    "cpu_attention.h",
    "cpu_attention_decode.h",
    "cpu_attention_lanes.h",
    "cpu_lora.h",
    "cpu_gguf.h",
    "cpu_gguf_blocks.h",
    "cpu_gguf_strip.h",
    "cpu_quant.h",
)
BASE_OPTIONS = ("-O3", "-fopenmp", "-shared", "-fPIC", "-std=gnu11", "-Wno-psabi")
# A compiler without an OpenMP runtime (clang without libomp) still builds the kernels, run on one
# thread: slower than torch's threads would be, faster than the reference forward.
SERIAL_OPTIONS = tuple(o for o in BASE_OPTIONS if o != "-fopenmp") + ("-Wno-unknown-pragmas",)
PREBUILT_DIR = HERE / "prebuilt"
# Comma-separated variant names `prebuild` limits itself to (an image for one CPU class, or a test
# that needs only the variant this machine picks); unset: every variant of the architecture.
PREBUILD_ENV = "PAGEDKV_PREBUILD_VARIANTS"
KEY_VERSION = 1


_P, _I64, _F32, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
_U64, _F64 = ctypes.c_uint64, ctypes.c_double
# name -> (restype, argtypes), in the C parameter order.
SIGNATURES = {
    "rms_norm": (None, (_P, _P, _P, _I64, _I64, _F32, _INT)),
    "add_rms_norm": (None, (_P, _P, _P, _P, _I64, _I64, _F32, _INT)),
    "qkv_rope_store": (None, (_P,) * 9 + (_INT, _I64, _I64, _I64, _I64, _F32, _P, _P, _F32, _F32, _INT)),
    "silu_mul": (None, (_P, _P, _I64, _I64, _INT)),
    "gather_rows": (None, (_INT, _P, _P, _P, _I64, _I64, _INT)),
    "pk_linear": (_INT, (_INT, _P, _I64, _P, _I64, _P, _P, _I64, _I64, _I64, _I64, _INT)),
    "pk_linear_argmax": (_INT, (_INT, _P, _P, _I64, _P, _P, _I64, _I64, _I64, _I64, _INT)),
    "pk_gather_rows": (None, (_INT, _P, _P, _P, _I64, _I64, _I64, _INT)),
    "pk_mlp": (_INT, (_P, _P, _P, _P, _P, _I64, _I64, _I64, _P, _INT)),
    "pk_mlp_scratch_bytes": (_I64, (_I64, _I64)),
    "pk_panel_share_check": (_INT, (_I64, _INT, _I64, _P, _P)),
    "pk_lane_argmax_check": (_INT, (_P, _I64, _I64, _I64, _P, _I64, _P)),
    "pq_linear": (
        _INT,
        (_INT, _P, _I64, _P, _I64, _P, _P, _INT, _P, _P, _I64, _I64, _I64, _I64, _I64, _INT, _INT),
    ),
    "pq_quantize_rows": (None, (_P, _P, _P, _P, _I64, _I64, _I64, _I64, _INT, _INT)),
    "pq_gather_rows": (None, (_INT, _P, _P, _P, _INT, _P, _P, _I64, _I64, _I64, _INT)),
    "gg_linear": (_INT, (_P, _I64, _P, _I64, _P, _I64, _P, _I64, _I64, _INT)),
    "gg_dequantize_rows": (_INT, (_INT, _P, _P, _P, _I64, _I64, _INT)),
    "gg_row_bytes": (_I64, (_INT, _I64)),
    "pk_decoder": (_INT, (_P, _P, _P, _P, _P, _INT)),
    "row_lse_topk": (_INT, (_P, _I64, _I64, _I64, _INT, _P, _P, _P, _INT)),
    "row_argmax": (None, (_P, _I64, _I64, _I64, _P, _INT)),
    "pk_decoder_scratch_bytes": (_I64, (_P, _I64)),
    # the tensor-parallel group's shared-memory collectives (cpu_shm.c, worker/tp/shm.py)
    "pk_shm_bytes": (_I64, (_INT, _I64)),
    "pk_shm_init": (_INT, (_P, _INT, _I64, _U64)),
    "pk_shm_join": (_INT, (_P, _INT, _INT, _I64, _U64, _I64)),
    "pk_shm_all_reduce_f32": (_INT, (_P, _INT, _INT, _I64, _P, _I64, _F64, _INT, _P)),
    "pk_shm_all_gather_f32": (_INT, (_P, _INT, _INT, _I64, _P, _I64, _I64, _P, _I64, _F64, _INT, _P)),
    "paged_attention": (
        _INT,
        (_P,) * 4 + (_INT, _P, _P, _F32, _F32, _P, _I64, _P, _P) + (_I64,) * 5 + (_F32, _I64, _INT),
    ),
}
DTYPES = {"float32": 0, "bfloat16": 1, "float16": 2}  # cpu_simd.h DT_* of weights and pools
KV_CODE_DTYPES = {"fp8_e4m3": 3, "fp8_e5m2": 4, "int8": 5}  # DT_* of quantized K/V pools only
MAX_HEADS_X_DIM = 8192  # one token's attention accumulators (cpu_attention.c MAX_HEADS_X_DIM)
MAX_HEAD_DIM = 512  # cpu_ops.c MAX_HEAD_DIM


class CpuOps:
    """A loaded library: its functions (ctypes signatures set) plus where it came from."""

    def __init__(self, path: Path, variant: str, origin: str) -> None:
        self.path, self.variant = path, variant
        self.origin = origin + (", single-threaded: no OpenMP in the compiler" if is_serial(path) else "")
        self._lib = ctypes.CDLL(str(path))
        for name, (restype, argtypes) in SIGNATURES.items():
            fn = getattr(self._lib, name)
            fn.restype, fn.argtypes = restype, argtypes
            setattr(self, name, fn)


# -- what to build and with what ------------------------------------------------------------------
def source_digest(directory: Path = HERE) -> str:
    digest = hashlib.sha256()
    for name in (*SOURCES, *HEADERS):
        if not (directory / name).exists():  # an older revision (bench.build_ab); the build fails first
            continue
        digest.update(name.encode() + b"\0" + (directory / name).read_bytes() + b"\0")
    return digest.hexdigest()


def compiler_command() -> list[str] | None:
    """$CC split like a shell would ("ccache gcc", "gcc -m64"), else cc / gcc on PATH."""
    if os.environ.get("CC"):
        argv = shlex.split(os.environ["CC"])
        found = shutil.which(argv[0]) if argv else None
        return [found, *argv[1:]] if found else None
    for name in ("cc", "gcc"):
        found = shutil.which(name)
        if found:
            return [found]
    return None


def compiler_identity(cc: list[str]) -> str:
    try:
        out = subprocess.run([*cc, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as exc:
        raise CpuKernelBuildError(f"the C compiler {shlex.join(cc)} does not run: {exc}") from None
    first = out.stdout.splitlines()[0] if out.stdout else ""
    return f"{shlex.join(cc)}: {first}"


def _key(variant: Variant, directory: Path, compiler: str, options: tuple[str, ...] = BASE_OPTIONS) -> dict:
    return {
        "version": KEY_VERSION,
        "variant": variant.name,
        "flags": [*options, *variant.flags],
        "sources": source_digest(directory),
        "compiler": compiler,
        "requires": sorted(variant.requires),
    }


def _run_compiler(command: list[str]) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(command, capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.SubprocessError) as exc:
        raise CpuKernelBuildError(f"the C compiler did not run: {exc}") from None


def _build_library(command: list[str], sources: list[Path], out: str) -> tuple[bool, str]:
    """Compile every source to an object, in parallel (one compiler per core: the attention
    units take most of a variant's 30-55 s of compiler time), then link `out`. (failed,
    compiler output)."""
    with tempfile.TemporaryDirectory(prefix="pagedkv-cc-") as objects:
        objs = [os.path.join(objects, f"{src.stem}.o") for src in sources]
        jobs = [[*command, "-c", str(src), "-o", obj] for src, obj in zip(sources, objs, strict=True)]
        with ThreadPoolExecutor(max_workers=max(1, min(len(jobs), os.cpu_count() or 1))) as pool:
            compiled = list(pool.map(_run_compiler, jobs))
        output = "".join(done.stdout + done.stderr for done in compiled)
        if any(done.returncode != 0 for done in compiled):
            return True, output
        linked = _run_compiler([*command, "-o", out, *objs, "-lm"])
        return linked.returncode != 0, output + linked.stdout + linked.stderr


def compile_variant(
    variant: Variant, out: Path, cc: list[str], sources_dir: Path = HERE, names: tuple[str, ...] = SOURCES
) -> Path:
    """Builds `out` (a .so) and its key file next to it, atomically (temp files renamed into
    place, key last: a library without a matching key is never loaded). `names`: the translation
    units (an older revision's kernels, bench.build_ab, may have fewer)."""
    identity = compiler_identity(cc)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=out.stem, suffix=".so.tmp", dir=out.parent)
        os.close(fd)
    except OSError as exc:
        raise CpuKernelBuildError(f"cannot write CPU kernels to {out.parent}: {exc}") from None
    try:
        sources = [sources_dir / name for name in names]
        options = BASE_OPTIONS
        failed, output = _build_library([*cc, *options, *variant.flags], sources, tmp)
        if failed and "omp" in output.lower():
            options = SERIAL_OPTIONS
            failed, output = _build_library([*cc, *options, *variant.flags], sources, tmp)
        if failed:
            raise CpuKernelBuildError(
                f"{shlex.join(cc)} failed to build the {variant.name} CPU kernels:\n{output.strip()}"
            )
        os.chmod(tmp, 0o755)  # mkstemp's 0600 would hide it from the service user of an image
        os.replace(tmp, out)
        key_tmp = out.with_suffix(".json.tmp")
        key_tmp.write_text(json.dumps(_key(variant, sources_dir, identity, options), indent=1))
        os.replace(key_tmp, out.with_suffix(".json"))
    except OSError as exc:
        raise CpuKernelBuildError(f"cannot write CPU kernels to {out.parent}: {exc}") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def key_matches(path: Path, variant: Variant, compiler: str | None) -> bool:
    """The library at `path` was built from these sources with these flags (and, when
    `compiler` is given, by that compiler)."""
    try:
        key = json.loads(path.with_suffix(".json").read_text())
    except (OSError, ValueError):
        return False
    if not isinstance(key, dict):
        return False
    options = SERIAL_OPTIONS if key.get("flags") == [*SERIAL_OPTIONS, *variant.flags] else BASE_OPTIONS
    want = _key(variant, HERE, compiler or key.get("compiler", ""), options)
    return path.is_file() and key == want


def is_serial(path: Path) -> bool:
    """Built without OpenMP (the compiler had no runtime): the kernels run on one thread."""
    try:
        return "-fopenmp" not in json.loads(path.with_suffix(".json").read_text())["flags"]
    except (OSError, ValueError, KeyError, TypeError):
        return False


# -- ahead of time ---------------------------------------------------------------------------------
def prebuild(out_dir: Path | None = None, sources_dir: Path = HERE, variants=None) -> list[str]:
    """Builds every variant of this machine's architecture into `out_dir` (make setup, pip
    install). A variant the compiler cannot build is skipped with a message; returns the built."""
    out_dir = PREBUILT_DIR if out_dir is None else out_dir
    variants = _prebuild_variants() if variants is None else variants
    cc = compiler_command()
    if cc is None:
        print("pagedkv: no C compiler: CPU kernels not prebuilt (the worker falls back)", file=sys.stderr)
        return []
    built = []
    for variant in variants:
        try:
            compile_variant(variant, out_dir / f"{variant.name}.so", cc, sources_dir)
            built.append(variant.name)
        except CpuKernelBuildError as exc:
            print(f"pagedkv: CPU kernels {variant.name} not prebuilt: {exc}", file=sys.stderr)
    return built


def _prebuild_variants() -> list[Variant]:
    variants = machine_variants()
    wanted = [name.strip() for name in os.environ.get(PREBUILD_ENV, "").split(",") if name.strip()]
    if not wanted:
        return variants
    unknown = sorted(set(wanted) - {v.name for v in variants})
    if unknown:
        names = ", ".join(v.name for v in variants)
        raise CpuKernelBuildError(
            f"{PREBUILD_ENV} names {', '.join(unknown)}, not variants of this machine ({names})"
        )
    return [v for v in variants if v.name in wanted]


def jit_path(variant: Variant, compiler: str, cache_dir: Path | None = None) -> Path:
    digest = hashlib.sha256(json.dumps(_key(variant, HERE, compiler)).encode()).hexdigest()[:24]
    return (cache_dir or default_cache_dir()) / f"cpu-{variant.name}-{digest}.so"


def build_in_cache(
    variant: Variant, cc: list[str], cache_dir: Path | None = None
) -> tuple[Path, Variant, str]:
    """Found in (or built into) the cache; an unwritable cache falls back to a private temp dir."""
    identity = compiler_identity(cc)
    path = jit_path(variant, identity, cache_dir)
    if key_matches(path, variant, identity):
        return path, variant, "cache"
    try:
        return compile_variant(variant, path, cc), variant, "built at start"
    except CpuKernelBuildError as exc:
        if "cannot write" not in str(exc) or cache_dir is not None:
            raise
    fallback = jit_path(variant, identity, Path(tempfile.gettempdir()) / f"pagedkv-{os.getuid()}" / "kernels")
    if key_matches(fallback, variant, identity):
        return fallback, variant, "cache"
    return compile_variant(variant, fallback, cc), variant, "built at start"


def find_or_build(
    cache_dir: Path | None = None, prebuilt_dir: Path | None = None
) -> tuple[Path, Variant, str]:
    """(library, variant, origin): the best variant this CPU runs, prebuilt if a matching one
    exists, else built now (or found) in the cache. Raises CpuKernelBuildError with every reason."""
    prebuilt_dir = PREBUILT_DIR if prebuilt_dir is None else prebuilt_dir
    reasons = []
    cc = compiler_command()
    variants, notes = choose_variants()
    for variant in variants:
        prebuilt = prebuilt_dir / f"{variant.name}.so"
        if key_matches(prebuilt, variant, None):
            return prebuilt, variant, "; ".join(["prebuilt", *notes, *reasons])
        if cc is None:
            reasons.append(
                f"{variant.name}: no prebuilt library for these sources, and no C compiler ($CC, cc, gcc)"
            )
            continue
        try:
            path, chosen, origin = build_in_cache(variant, cc, cache_dir)
            return path, chosen, "; ".join([origin, *notes, *reasons])
        except CpuKernelBuildError as exc:
            reasons.append(f"{variant.name}: {exc}")
    if not reasons:
        reasons.append("no kernel variant for this CPU")
    raise CpuKernelBuildError("; ".join([*reasons, *notes]))


@cache
def load_cpu_ops() -> CpuOps:
    """Find or build, then load, the kernels once per process."""
    import torch  # noqa: F401 -- first, so that libgomp resolves to torch's copy

    path, variant, origin = find_or_build()
    try:
        return CpuOps(path, variant.name, origin)
    except (OSError, AttributeError) as exc:
        raise CpuKernelBuildError(f"cannot load {path}: {exc}") from None


if __name__ == "__main__":
    # `python -m kernels.cpu_build --prebuild [DIR]`: what make setup runs. `--prebuild-tests`:
    # also the tests' emulated AMX build (never a worker's; not in wheels), where its ISA runs here.
    if len(sys.argv) >= 2 and sys.argv[1] in ("--prebuild", "--prebuild-tests"):
        target = Path(sys.argv[2]) if len(sys.argv) > 2 else PREBUILT_DIR
        variants = _prebuild_variants()
        if sys.argv[1] == "--prebuild-tests" and AMX_EMULATED.requires <= cpu_features():
            variants = [*variants, AMX_EMULATED]
        built = prebuild(target, variants=variants)
        print(f"pagedkv: CPU kernels prebuilt in {target}: {', '.join(built) or 'none'}")
    else:
        print("usage: python -m kernels.cpu_build --prebuild[-tests] [DIR]", file=sys.stderr)
        sys.exit(2)
