"""Run-time build of the fast CPU worker's C kernels (kernels/cpu_ops.c), the CPU twin of NVRTC.

    cpu_ops.c ──cc -O3 -march=native -fopenmp -shared──▶ $PAGEDKV_CACHE_DIR/kernels/cpu-<key>.so
                                                        ──ctypes──▶ CpuOps (GIL released per call)

The key is a SHA-256 of the source, the compiler's identity, the options and this CPU's model
and flags (-march=native code is only valid on the CPU it was built for), so an edit, a
compiler upgrade or a different host misses the cache. The library is written to a temporary
name and renamed into place: concurrent workers never load half a file.

It must be loaded after torch: its libgomp dependency then resolves (by SONAME) to the copy
torch already loaded, so the kernels and torch's GEMMs share one OpenMP thread pool instead of
two pools fighting over the cores. `load_cpu_ops` raises CpuKernelBuildError with the
compiler's output when there is no compiler or the build fails; the worker then serves with
the reference ops and says why.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

from kernels.cubin_cache import default_cache_dir

SOURCE = Path(__file__).with_name("cpu_ops.c")
OPTIONS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=gnu11")
COMPILER_ENV = "CC"

_P, _I64, _F32, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
# name -> (restype, argtypes), in cpu_ops.c's parameter order.
SIGNATURES = {
    "rms_norm": (None, (_P, _P, _P, _I64, _I64, _F32, _INT)),
    "add_rms_norm": (None, (_P, _P, _P, _P, _I64, _I64, _F32, _INT)),
    "qkv_rope_store": (None, (_P,) * 9 + (_I64, _I64, _I64, _I64, _F32, _INT)),
    "silu_mul": (None, (_P, _P, _I64, _I64, _INT)),
    "row_linear": (None, (_P, _P, _P, _P, _I64, _I64, _INT)),
    "paged_attention": (
        _INT,
        (_P, _P, _P, _P, _P, _I64, _P, _P, _I64, _I64, _I64, _I64, _I64, _F32, _INT),
    ),
}
MAX_HEADS_X_DIM = 8192  # one token's attention accumulators (cpu_ops.c MAX_HEADS_X_DIM)
MAX_HEAD_DIM = 512  # norm_rope_head's buffer


class CpuKernelBuildError(RuntimeError):
    """No C compiler, or it rejected cpu_ops.c; the message carries its output."""


class CpuOps:
    """The loaded library; attributes are its functions with ctypes signatures set."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lib = ctypes.CDLL(str(path))
        for name, (restype, argtypes) in SIGNATURES.items():
            fn = getattr(self._lib, name)
            fn.restype, fn.argtypes = restype, argtypes
            setattr(self, name, fn)


def compiler() -> str | None:
    """The C compiler to use: $CC, else cc or gcc on PATH."""
    candidates = [os.environ[COMPILER_ENV]] if os.environ.get(COMPILER_ENV) else ["cc", "gcc"]
    for name in candidates:
        found = shutil.which(name)
        if found:
            return found
    return None


def _cpu_identity() -> str:
    """Model name and feature flags of this CPU (what -march=native compiles for)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    keep = [ln for ln in lines if ln.split(":")[0].strip() in ("model name", "flags", "Features")]
    return "\n".join(sorted(set(keep))) or platform.machine()


def _compiler_version(cc: str) -> str:
    out = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=60)
    return out.stdout.splitlines()[0] if out.stdout else cc


def library_path(cc: str, cache_dir: Path | None = None) -> Path:
    digest = hashlib.sha256()
    for part in (SOURCE.read_text(), _compiler_version(cc), " ".join(OPTIONS), _cpu_identity()):
        digest.update(part.encode())
        digest.update(b"\x1f")
    return (cache_dir or default_cache_dir()) / f"cpu-{digest.hexdigest()[:32]}.so"


def build(cache_dir: Path | None = None) -> Path:
    """The compiled library's path, compiling it when the cache has no entry for this key."""
    cc = compiler()
    if cc is None:
        raise CpuKernelBuildError("no C compiler found (set $CC or install gcc) to build kernels/cpu_ops.c")
    path = library_path(cc, cache_dir)
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.stem, suffix=".so.tmp", dir=path.parent)
    os.close(fd)
    try:
        out = subprocess.run(
            [cc, *OPTIONS, "-o", tmp, str(SOURCE), "-lm"], capture_output=True, text=True, timeout=300
        )
        if out.returncode != 0:
            raise CpuKernelBuildError(f"{cc} failed to build {SOURCE.name}:\n{out.stdout}{out.stderr}")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


@cache
def load_cpu_ops() -> CpuOps:
    """Build (or find in the cache) and load the kernels once per process."""
    import torch  # noqa: F401 -- first, so that libgomp resolves to torch's copy

    return CpuOps(build())
