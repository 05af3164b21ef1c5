"""The CUDA quantized-KV arithmetic (kernels/kv_quant.cuh) against the CPU kernels' functions
(kernels/cpu_kv_quant.h) and the torch oracle (worker/kv_quant.py), bit for bit, without a GPU:
the header's software path is plain C, so the host compiler builds it next to the CPU header
into one small library (the sm_87 path, and sm_89+'s scale and int8 math; the native fp8
conversions agree on every finite value, checked by tests/gpu/test_kv_quant_cuda.py)."""

from __future__ import annotations

import ctypes
import subprocess

import numpy as np
import pytest
import torch

from kernels.cpu_build import compiler_command
from kernels.specs import KERNEL_DIR
from worker.kv_quant import FORMATS, quantize, scale_of

SHIM = r"""
#include "cpu_kv_quant.h"
#include "kv_quant.cuh"
void decode_all(int fmt, float *cpu, float *cuh) {
    for (int b = 0; b < 256; ++b) {
        uint8_t c = (uint8_t)b;
        cpu[b] = load1_code(&c, 0, fmt) * kv_code_unit(fmt);
        cuh[b] = kvq_decode(c, fmt);
    }
}
void encode_both(int fmt, const float *y, int64_t n, uint8_t *cpu, uint8_t *cuh) {
    for (int64_t i = 0; i < n; ++i) cpu[i] = kv_encode(y[i], fmt), cuh[i] = kvq_encode(y[i], fmt);
}
void scale_bytes_both(int fmt, const float *amax, int64_t n, uint8_t *cpu, uint8_t *cuh) {
    for (int64_t i = 0; i < n; ++i)
        cpu[i] = kv_scale_byte(amax[i], fmt), cuh[i] = kvq_scale_byte(amax[i], fmt);
}
void scales_of_both(float *cpu, float *cuh) {
    for (int b = 0; b < 256; ++b) cpu[b] = kv_scale_of((uint8_t)b), cuh[b] = kvq_scale_of((unsigned char)b);
}
void quantize_cuh(int fmt, const float *x, const uint8_t *bytes, int64_t rows, int64_t dim, uint8_t *codes) {
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t d = 0; d < dim; ++d) codes[r * dim + d] = kvq_quantize(x[r * dim + d], bytes[r], fmt);
}
int scale_byte_cuh(float amax, int fmt) { return kvq_scale_byte(amax, fmt); }
long long scale_index_cuh(long long slot, int kv_heads, int head) {
    return kvq_scale_index(slot, kv_heads, head);
}
"""


@pytest.fixture(scope="module")
def shim(tmp_path_factory):
    cc = compiler_command()
    if cc is None:
        pytest.skip("no C compiler on this machine: the header cannot be built for the host")
    directory = tmp_path_factory.mktemp("kvq-cuh")
    (directory / "shim.c").write_text(SHIM)
    library = directory / "shim.so"
    subprocess.run(
        [*cc, "-O2", "-shared", "-fPIC", "-Wno-psabi", "-I", str(KERNEL_DIR), "-o", str(library),
         str(directory / "shim.c")],
        check=True, capture_output=True,
    )  # fmt: skip
    return ctypes.CDLL(str(library))


def ptr(array: np.ndarray) -> ctypes.c_void_p:
    return ctypes.c_void_p(array.ctypes.data)


def both(shim, function: str, fmt_code: int, inputs: np.ndarray, out_dtype) -> tuple[np.ndarray, np.ndarray]:
    cpu, cuh = np.empty(inputs.size, out_dtype), np.empty(inputs.size, out_dtype)
    getattr(shim, function)(fmt_code, ptr(inputs), ctypes.c_int64(inputs.size), ptr(cpu), ptr(cuh))
    return cpu, cuh


@pytest.mark.parametrize("name", list(FORMATS))
def test_every_code_decodes_as_the_cpu_kernel_decodes_it(shim, name):
    fmt = FORMATS[name]
    cpu, cuh = np.empty(256, np.float32), np.empty(256, np.float32)
    shim.decode_all(fmt.code, ptr(cpu), ptr(cuh))
    nan = np.isnan(cpu)
    assert np.array_equal(nan, np.isnan(cuh))  # e5m2's NaN codes (payloads may differ)
    assert np.array_equal(cpu[~nan].view(np.uint32), cuh[~nan].view(np.uint32))  # -0.0 included
    want = torch.arange(256, dtype=torch.uint8).view(fmt.torch_dtype).float().numpy()
    finite = np.isfinite(want)
    assert np.array_equal(cuh[finite], want[finite])  # NaN codes are never stored from finite values


def encoder_inputs(fmt, seed: int) -> np.ndarray:
    """Every code's value, the midpoints between neighbours (ties), values just off them, a
    wide random spread, zeros, +-qmax and beyond (saturation), and infinities."""
    gen = np.random.default_rng(seed)
    codes = torch.arange(256, dtype=torch.uint8).view(fmt.torch_dtype).float().numpy()
    codes = np.unique(codes[np.isfinite(codes)]).astype(np.float32)
    mids = ((codes[1:].astype(np.float64) + codes[:-1]) / 2).astype(np.float32)
    spread = (gen.standard_normal(20000) * 10.0 ** gen.uniform(-12, 6, 20000)).astype(np.float32)
    edges = np.array([0.0, -0.0, fmt.qmax, -fmt.qmax, 2 * fmt.qmax, -1e30, np.inf, -np.inf], np.float32)
    near = np.concatenate([np.nextafter(mids, np.float32(np.inf)), np.nextafter(mids, np.float32(-np.inf))])
    return np.concatenate([codes, mids, near, spread, edges]).astype(np.float32)


@pytest.mark.parametrize("name", list(FORMATS))
def test_the_encoder_writes_the_cpu_kernels_codes(shim, name):
    fmt = FORMATS[name]
    values = encoder_inputs(fmt, seed=fmt.code)
    cpu, cuh = both(shim, "encode_both", fmt.code, values, np.uint8)
    assert np.array_equal(cpu, cuh)


@pytest.mark.parametrize("name", list(FORMATS))
def test_scale_bytes_and_scales_are_the_cpu_kernels(shim, name):
    fmt = FORMATS[name]
    gen = np.random.default_rng(7)
    amax = np.concatenate([
        10.0 ** gen.uniform(-12, 9, 20000), scale_of(torch.arange(256, dtype=torch.uint8)).numpy() * fmt.qmax,
        [0.0, np.inf, np.nan, 1e38],
    ]).astype(np.float32)  # fmt: skip
    cpu, cuh = both(shim, "scale_bytes_both", fmt.code, amax, np.uint8)
    assert np.array_equal(cpu, cuh)
    cpu_s, cuh_s = np.empty(256, np.float32), np.empty(256, np.float32)
    shim.scales_of_both(ptr(cpu_s), ptr(cuh_s))
    assert np.array_equal(cpu_s, cuh_s) and np.array_equal(
        cuh_s, scale_of(torch.arange(256, dtype=torch.uint8)).numpy()
    )


@pytest.mark.parametrize("name", list(FORMATS))
def test_a_head_quantizes_to_the_oracles_codes(shim, name):
    """What the CUDA write kernel computes per (token, kv head) -- the byte of the row's amax,
    then each value through kvq_quantize -- equals worker/kv_quant.quantize."""
    fmt = FORMATS[name]
    gen = torch.Generator().manual_seed(11)
    rows, dim = 500, 64
    x = torch.randn(rows, dim, generator=gen) * torch.pow(
        10.0, torch.empty(rows, 1).uniform_(-8, 7, generator=gen)
    )
    x[::9] = 0.0
    want_codes, want_bytes = quantize(x, fmt)
    amax = x.abs().amax(-1).numpy()
    shim.scale_byte_cuh.restype = ctypes.c_int
    got_bytes = np.array([shim.scale_byte_cuh(ctypes.c_float(a), fmt.code) for a in amax], np.uint8)
    assert np.array_equal(got_bytes, want_bytes.numpy())
    codes = np.empty((rows, dim), np.uint8)
    xs = np.ascontiguousarray(x.numpy())
    shim.quantize_cuh(
        fmt.code, ptr(xs), ptr(got_bytes), ctypes.c_int64(rows), ctypes.c_int64(dim), ptr(codes)
    )
    assert np.array_equal(codes, want_codes.numpy())


def test_scale_bytes_are_found_where_the_pools_keep_them(shim):
    """kvq_scale_index(block * block_size + offset, kv_heads, head) is the flat index of
    [block, offset, head] in the worker's scale pool, and times head_dim the codes' row (as the
    kernels' kv_offset): a block copy of both pools moves a token's codes and byte together."""
    shim.scale_index_cuh.restype = ctypes.c_longlong
    blocks, block_size, kv_heads, head_dim = 5, 8, 3, 16
    pool = torch.arange(blocks * block_size * kv_heads).reshape(blocks, block_size, kv_heads)
    codes = torch.arange(blocks * block_size * kv_heads * head_dim).reshape(
        blocks, block_size, kv_heads, head_dim
    )
    for block, offset, head in [(0, 0, 0), (4, 7, 2), (2, 3, 1), (3, 0, 2)]:
        at = shim.scale_index_cuh(ctypes.c_longlong(block * block_size + offset), kv_heads, head)
        assert at == pool[block, offset, head]
        assert at * head_dim == codes[block, offset, head, 0]
