"""Run-time compilation of the CUDA C++ sources with NVRTC (through `cuda.bindings.nvrtc`).

One `compile_source` call turns one `.cu` file plus its in-memory headers into a cubin for
one arch (`sm_87`, `sm_90`, ...), instantiating the requested templates through NVRTC name
expressions (`"pkv::write_kv_kernel<pkv::f16>"` -> its mangled "lowered" name). No GPU and no
driver are needed: CI compiles every instantiation for sm_87 and sm_90 on a CPU machine.

The sources include no CUDA headers (see kernels/common.cuh), so NVRTC is the only CUDA
component needed at build time. ptxas runs with `-v`; its report (registers, shared
memory, spills, stack) is parsed into `ResourceUsage` per kernel, available without a GPU;
a kernel the log does not report is read from the cubin's own tables (kernels.cubin_info).

A failed compile raises `KernelCompileError` carrying the full NVRTC log.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from kernels.cubin_info import kernel_resources
from kernels.resources import ResourceUsage

MIN_ARCH = 80  # cp.async, ldmatrix, bf16 mma and cvt.rn.bf16 need sm_80 or newer
BASE_OPTIONS = ("-std=c++17", "--ptxas-options=-v")


class KernelCompileError(RuntimeError):
    """NVRTC rejected a program; `log` holds the compiler's full output."""

    def __init__(self, message: str, log: str = "") -> None:
        super().__init__(f"{message}\n--- NVRTC log ---\n{log}" if log else message)
        self.log = log


@dataclass(frozen=True, slots=True)
class CompiledProgram:
    """A cubin plus what is needed to use it: name expression -> lowered (mangled) name,
    lowered name -> resources, and the NVRTC log."""

    arch: str
    cubin: bytes
    lowered_names: Mapping[str, str]
    resources: Mapping[str, ResourceUsage]
    log: str

    def resources_of(self, name_expression: str) -> ResourceUsage:
        lowered = self.lowered_names[name_expression]
        try:
            return self.resources[lowered]
        except KeyError:  # the log is what tells why: a format this parser does not know
            raise KeyError(
                f"ptxas -v reported no resources for {name_expression} ({lowered}) on {self.arch}; "
                f"parsed entries: {sorted(self.resources)}; NVRTC log: {self.log[:1500]!r}"
            ) from None


def nvrtc_version() -> tuple[int, int]:
    nvrtc = _nvrtc()
    err, major, minor = nvrtc.nvrtcVersion()
    _check(err, "nvrtcVersion")
    return int(major), int(minor)


def supported_archs() -> list[int]:
    """Compute capabilities this NVRTC can generate code for, e.g. [75, 80, 86, 87, 89, 90, ...]."""
    nvrtc = _nvrtc()
    err, num = nvrtc.nvrtcGetNumSupportedArchs()
    _check(err, "nvrtcGetNumSupportedArchs")
    err, archs = nvrtc.nvrtcGetSupportedArchs()
    _check(err, "nvrtcGetSupportedArchs")
    return [int(a) for a in archs[:num]]


def normalize_arch(arch: str | int) -> str:
    """'sm_90' / '90' / 90 / 'sm_90a' -> 'sm_90' / 'sm_90a'; refuses archs below sm_80."""
    text = str(arch).strip().lower().removeprefix("sm_").removeprefix("compute_")
    match = re.fullmatch(r"(\d+)([af]?)", text)
    if match is None:
        raise ValueError(f"not a CUDA arch: {arch!r} (expected e.g. 'sm_90')")
    if int(match.group(1)) < MIN_ARCH:
        raise ValueError(
            f"arch sm_{match.group(1)} is not supported: the kernels need sm_{MIN_ARCH} or newer"
        )
    return f"sm_{match.group(1)}{match.group(2)}"


def compile_source(
    name: str,
    source: str,
    headers: Mapping[str, str],
    name_expressions: Sequence[str],
    arch: str,
    options: Sequence[str] = (),
) -> CompiledProgram:
    """Compile `source` (file name `name`) to a cubin for `arch`; instantiate `name_expressions`."""
    nvrtc = _nvrtc()
    arch = normalize_arch(arch)
    header_names = list(headers)
    err, prog = nvrtc.nvrtcCreateProgram(
        source.encode(),
        name.encode(),
        len(header_names),
        [headers[h].encode() for h in header_names],
        [h.encode() for h in header_names],
    )
    _check(err, f"nvrtcCreateProgram({name})")
    try:
        for expr in name_expressions:
            (err,) = nvrtc.nvrtcAddNameExpression(prog, expr.encode())
            _check(err, f"nvrtcAddNameExpression({expr})")
        opts = [f"--gpu-architecture={arch}", *BASE_OPTIONS, *options]
        (result,) = nvrtc.nvrtcCompileProgram(prog, len(opts), [o.encode() for o in opts])
        log = _program_log(nvrtc, prog)
        if result != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise KernelCompileError(f"NVRTC failed to compile {name} for {arch} with options {opts}", log)
        lowered = {}
        for expr in name_expressions:
            err, mangled = nvrtc.nvrtcGetLoweredName(prog, expr.encode())
            _check(err, f"nvrtcGetLoweredName({expr})")
            lowered[expr] = mangled.decode()
        cubin = _cubin(nvrtc, prog)
    finally:
        nvrtc.nvrtcDestroyProgram(prog)
    return CompiledProgram(arch, cubin, lowered, program_resources(log, cubin, lowered.values()), log)


def program_resources(log: str, cubin: bytes, kernels: Iterable[str]) -> dict[str, ResourceUsage]:
    """ptxas's report from the log, and from the cubin for any kernel the log lacks (NVRTC 13.0
    on an H200 returned empty logs for some compiles; docs/GPU_VALIDATION.md)."""
    usage = parse_ptxas_log(log)
    missing = [k for k in kernels if k not in usage]
    if missing:
        table = kernel_resources(cubin)
        usage.update({name: table[name] for name in missing if name in table})
    return usage


_ENTRY = re.compile(r"Compiling entry function '([^']+)'")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_REGS = re.compile(r"Used (\d+) registers")
_SMEM = re.compile(r"(\d+) bytes smem")


def parse_ptxas_log(log: str) -> dict[str, ResourceUsage]:
    """Per-kernel resource usage from ptxas's -v report (one block of lines per entry)."""
    usage: dict[str, ResourceUsage] = {}
    blocks = _ENTRY.split(log)  # [preamble, name1, body1, name2, body2, ...]
    for entry, body in zip(blocks[1::2], blocks[2::2], strict=True):
        regs, frame, smem = _REGS.search(body), _FRAME.search(body), _SMEM.search(body)
        if regs is None or frame is None:
            continue
        usage[entry] = ResourceUsage(
            registers=int(regs.group(1)),
            static_smem=int(smem.group(1)) if smem else 0,
            stack_frame=int(frame.group(1)),
            spill_stores=int(frame.group(2)),
            spill_loads=int(frame.group(3)),
        )
    return usage


def _program_log(nvrtc, prog) -> str:
    err, size = nvrtc.nvrtcGetProgramLogSize(prog)
    _check(err, "nvrtcGetProgramLogSize")
    buffer = bytes(size)  # not b" " * size: at size 1 (an empty log) that is the shared b" "
    (err,) = nvrtc.nvrtcGetProgramLog(prog, buffer)
    _check(err, "nvrtcGetProgramLog")
    return buffer.rstrip(b"\0").decode(errors="replace")


def _cubin(nvrtc, prog) -> bytes:
    err, size = nvrtc.nvrtcGetCUBINSize(prog)
    _check(err, "nvrtcGetCUBINSize")
    buffer = bytes(size)
    (err,) = nvrtc.nvrtcGetCUBIN(prog, buffer)
    _check(err, "nvrtcGetCUBIN")
    return bytes(buffer)


def _check(err, what: str) -> None:
    nvrtc = _nvrtc()
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        _, text = nvrtc.nvrtcGetErrorString(err)
        raise KernelCompileError(f"{what} failed: {text.decode(errors='replace')}")


def nvrtc_library_path() -> str:
    """Absolute path of the NVRTC shared library in use (found by cuda.pathfinder: the
    nvidia-cuda-nvrtc wheel first, then conda, then the system CUDA install)."""
    _nvrtc()
    return _NVRTC_STATE["path"]


_NVRTC_STATE: dict[str, object] = {}


def _nvrtc():
    """cuda.bindings.nvrtc, imported and its library located on first use, with an actionable
    error when either is missing."""
    module = _NVRTC_STATE.get("module")
    if module is not None:
        return module
    try:
        import cuda.pathfinder
        from cuda.bindings import nvrtc
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise KernelCompileError(
            "cuda-python is not installed: install the CUDA extra (pip install -e '.[cuda]'), "
            f"which brings cuda-bindings, cuda-pathfinder and the NVRTC wheel ({exc})"
        ) from exc
    try:
        loaded = cuda.pathfinder.load_nvidia_dynamic_lib("nvrtc")
    except Exception as exc:  # pathfinder raises several error types, all meaning "not usable"
        raise KernelCompileError(
            f"the NVRTC library could not be loaded ({exc}); install nvidia-cuda-nvrtc "
            "(the CUDA extra) or a CUDA toolkit"
        ) from exc
    _NVRTC_STATE["path"] = loaded.abs_path
    _NVRTC_STATE["module"] = nvrtc
    return nvrtc
