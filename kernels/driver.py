"""Loading and launching the compiled kernels with the CUDA driver API (`cuda.bindings.driver`).

    DriverDevice(ordinal)            primary context of the device (the one torch uses), arch,
                                     SM count, shared-memory limit, driver/NVRTC compatibility
      .load(spec, cache)             compile-on-first-use for the device's arch (kernels.build,
                                     through the cubin cache) -> cuModuleLoadData -> one
                                     LoadedKernel per name expression
    LoadedKernel.launch(cfg, args, stream)   cuLaunchKernel on the caller's (torch's) stream

Context: torch's CUDA runtime works in the device's *primary* context. The caller must have
initialised torch on the device first (the CUDA backend does: torch.cuda.init() and one
allocation); `cuDevicePrimaryCtxRetain` then returns that same context, modules load into it,
and `make_current` sets it on any thread that launches (the driver API launches into the
calling thread's current context; a thread torch has not touched may have none).

Driver compatibility: a cubin from NVRTC major version N needs a driver of CUDA N or newer.
The pip wheel `nvidia-cuda-nvrtc` 13.x therefore cannot feed a CUDA 12 driver (JetPack 6 on
Orin). Instead of letting cuModuleLoadData fail with an opaque error, `check_driver_compatible`
refuses up front and says which NVRTC to install.

Only `select_arch` and `check_driver_compatible` are pure; everything else needs a device.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass

from kernels.build import compile_program
from kernels.cubin_cache import CubinCache
from kernels.launch import KernelArgs, LaunchConfig
from kernels.nvrtc import MIN_ARCH, CompiledProgram, nvrtc_version, supported_archs
from kernels.specs import ProgramSpec


class KernelLoadError(RuntimeError):
    """The driver refused an operation (load, attribute, launch) or the setup is unusable."""


def select_arch(capability: tuple[int, int], supported: Sequence[int]) -> str:
    """The arch to compile for on a device of compute `capability`.

    The exact arch when NVRTC supports it; otherwise the newest supported arch of the same
    major version and a lower minor (SASS runs on later minors of its major: an sm_80 cubin
    runs on sm_86/87/89, never on sm_90).
    """
    major, minor = capability
    device = major * 10 + minor
    if device < MIN_ARCH:
        raise KernelLoadError(
            f"compute capability {major}.{minor} is too old: the kernels need sm_{MIN_ARCH}+"
        )
    if device in supported:
        return f"sm_{device}"
    same_major = [a for a in supported if a // 10 == major and a <= device]
    if not same_major:
        raise KernelLoadError(
            f"this NVRTC cannot generate code for sm_{device} (it supports {sorted(supported)}); "
            "install a newer nvidia-cuda-nvrtc"
        )
    return f"sm_{max(same_major)}"


def check_driver_compatible(nvrtc: tuple[int, int], driver_version: int) -> None:
    """Raise if cubins from this NVRTC cannot load on this driver (driver_version as
    cuDriverGetVersion reports it: 1000 * major + 10 * minor, e.g. 12060)."""
    driver_major = driver_version // 1000
    if nvrtc[0] > driver_major:
        raise KernelLoadError(
            f"NVRTC {nvrtc[0]}.{nvrtc[1]} makes cubins that need a CUDA {nvrtc[0]} driver, but the "
            f"installed driver supports CUDA {driver_major}.{driver_version % 1000 // 10}. Install the "
            f"NVRTC that matches the driver, e.g. `pip uninstall nvidia-cuda-nvrtc && pip install "
            f"'nvidia-cuda-nvrtc-cu{driver_major}'` (on Jetson with JetPack, use the CUDA toolkit's "
            "libnvrtc: uninstall the wheel and cuda.pathfinder finds /usr/local/cuda), or upgrade the driver."
        )


def _driver():
    try:
        from cuda.bindings import driver
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise KernelLoadError(f"cuda-python is not installed (pip install -e '.[cuda]'): {exc}") from exc
    return driver


def check(result: tuple, what: str):
    """Unwrap a cuda.bindings call result `(CUresult, *values)`: the value(s) or an error."""
    cu = _driver()
    err, *values = result
    if err != cu.CUresult.CUDA_SUCCESS:
        _, name = cu.cuGetErrorName(err)
        _, text = cu.cuGetErrorString(err)
        decode = lambda b: b.decode(errors="replace") if isinstance(b, bytes) else str(b)
        raise KernelLoadError(f"{what} failed: {decode(name)} ({decode(text)})")
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


@dataclass(frozen=True, slots=True)
class LoadedKernel:
    """One kernel function in a loaded module, with the limits its launches are checked against."""

    name: str
    function: object  # CUfunction
    static_smem: int
    max_dynamic_smem: int
    registers: int

    def launch(self, config: LaunchConfig, args: KernelArgs, stream: int) -> None:
        if config.smem_bytes > self.max_dynamic_smem:
            raise KernelLoadError(
                f"{self.name}: launch needs {config.smem_bytes} bytes of dynamic shared memory, "
                f"the limit is {self.max_dynamic_smem}"
            )
        if min(config.grid) < 1:
            raise KernelLoadError(f"{self.name}: empty grid {config.grid}")
        cu = _driver()
        gx, gy, gz = config.grid
        bx, by, bz = config.block
        check(
            cu.cuLaunchKernel(
                self.function, gx, gy, gz, bx, by, bz, config.smem_bytes, stream, args.pointer, 0
            ),
            f"cuLaunchKernel({self.name}, grid={config.grid})",
        )


class DriverDevice:
    """The driver-side view of one CUDA device, in torch's primary context."""

    def __init__(self, ordinal: int) -> None:
        cu = _driver()
        check(cu.cuInit(0), "cuInit")
        self.ordinal = ordinal
        self.driver_version = int(check(cu.cuDriverGetVersion(), "cuDriverGetVersion"))
        self.device = check(cu.cuDeviceGet(ordinal), f"cuDeviceGet({ordinal})")
        self.context = check(cu.cuDevicePrimaryCtxRetain(self.device), "cuDevicePrimaryCtxRetain")
        current = check(cu.cuCtxGetCurrent(), "cuCtxGetCurrent")
        if int(current) not in (0, int(self.context)):
            raise KernelLoadError(
                "the calling thread's current CUDA context is not the device's primary context that "
                "torch uses; kernels loaded here would be invisible to torch's streams"
            )
        self.make_current()
        attr = cu.CUdevice_attribute
        major = self._attribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)
        minor = self._attribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)
        self.capability = (major, minor)
        self.num_sms = self._attribute(attr.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
        self.max_smem_optin = self._attribute(attr.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
        check_driver_compatible(nvrtc_version(), self.driver_version)
        self.arch = select_arch(self.capability, supported_archs())
        self._modules: list[tuple[object, ctypes.Array]] = []  # kept alive for the process

    def make_current(self) -> None:
        """Make the primary context current on the calling thread. Checked on every call, not
        cached: torch's device guards may switch the thread to another device's context."""
        cu = _driver()
        if int(check(cu.cuCtxGetCurrent(), "cuCtxGetCurrent")) != int(self.context):
            check(cu.cuCtxSetCurrent(self.context), "cuCtxSetCurrent")

    def load(self, spec: ProgramSpec, cache: CubinCache | None) -> dict[str, LoadedKernel]:
        """Compile (or fetch from the cache) and load `spec`; kernels by name expression."""
        self.make_current()
        program = compile_program(spec, self.arch, cache)
        return self.load_compiled(program, spec.name_expressions)

    def load_compiled(self, program: CompiledProgram, names: Sequence[str]) -> dict[str, LoadedKernel]:
        cu = _driver()
        image = ctypes.create_string_buffer(program.cubin, len(program.cubin))
        module = check(cu.cuModuleLoadData(ctypes.addressof(image)), f"cuModuleLoadData({program.arch})")
        self._modules.append((module, image))
        kernels = {}
        for name in names:
            lowered = program.lowered_names[name]
            function = check(cu.cuModuleGetFunction(module, lowered.encode()), f"cuModuleGetFunction({name})")
            kernels[name] = self._configure(name, function)
        return kernels

    def _configure(self, name: str, function) -> LoadedKernel:
        """Raise the function's dynamic shared-memory limit to what the device allows beside
        its static shared memory (needed above 48 KB: prefill tiles, long single-pass decode)."""
        cu = _driver()
        fattr = cu.CUfunction_attribute
        static = int(check(cu.cuFuncGetAttribute(fattr.CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, function), name))
        registers = int(check(cu.cuFuncGetAttribute(fattr.CU_FUNC_ATTRIBUTE_NUM_REGS, function), name))
        dynamic = self.max_smem_optin - static
        check(
            cu.cuFuncSetAttribute(function, fattr.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, dynamic),
            f"cuFuncSetAttribute({name}, max dynamic smem = {dynamic})",
        )
        return LoadedKernel(name, function, static, dynamic, registers)

    def _attribute(self, attribute) -> int:
        cu = _driver()
        return int(
            check(cu.cuDeviceGetAttribute(attribute, self.device), f"cuDeviceGetAttribute({attribute})")
        )
