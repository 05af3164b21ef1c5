"""Kernel launch arguments (issue 15): host cost of packing one launch's parameters for
`cuLaunchKernel` (kernels.launch.KernelArgs), measured on the CPU (no GPU needed), against the
one-ctypes-object-per-value packing it replaced (rebuilt here as the baseline), for the
decode kernel's 16 parameters and write_kv's 8. Eager steps pay it about three times per layer.

Run: `python -m bench.launch_args [--quick]`.
"""

from __future__ import annotations

import ctypes
import time

from bench.common import median
from bench.suite_cli import suite_main
from kernels.launch import DECODE_SIGNATURE, F32, I32, I64, PTR, WRITE_KV_SIGNATURE, KernelArgs


def _per_value_packing(signature, values):
    """The replaced packing: a ctypes object per value, pointers cast one by one."""
    typed = [ctype(value) for ctype, value in zip(signature, values, strict=True)]
    pointers = (ctypes.c_void_p * len(typed))(
        *(ctypes.cast(ctypes.pointer(v), ctypes.c_void_p) for v in typed)
    )
    return typed, ctypes.addressof(pointers)


def _us_per_call(fn, calls: int, repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - started) / calls * 1e6)
    return median(samples)


def run(quick: bool = False) -> dict:
    calls, repeats = (500, 3) if quick else (5000, 7)
    res = {}
    for name, signature in (("decode", DECODE_SIGNATURE), ("write_kv", WRITE_KV_SIGNATURE)):
        sample = {PTR: 0x7F00_0000_1000, I64: 1 << 20, I32: 64, F32: 0.5}
        values = [sample[ctype] for ctype in signature]
        res[f"{name}_args"] = len(signature)
        res[f"{name}_pack_us"] = _us_per_call(
            lambda s=signature, v=values: KernelArgs(s, v).pointer, calls, repeats
        )
        res[f"{name}_per_value_baseline_us"] = _us_per_call(
            lambda s=signature, v=values: _per_value_packing(s, v), calls, repeats
        )
        res[f"{name}_speedup"] = res[f"{name}_per_value_baseline_us"] / res[f"{name}_pack_us"]
    return res


def main() -> None:
    suite_main(run, __doc__)


if __name__ == "__main__":
    main()
