"""The quantized-linear kernels (kernels/quant_linear.cu) on a GPU, through CudaQuantLinear, against
the CPU's dequantized weight: the GEMV for 1-8 rows (NaN-poisoned output, every element must be
written; odd N, several groups, two thread steps over K, a strided x), the dequantize kernel
(bitwise QuantizedWeight.dequantize), the dequantize + cuBLAS path for more rows, and both inside
a captured CUDA graph replayed on new inputs.

Test ids name the dtype fp32 / fp16 / bf16 and the kernel (gemv / dequant), so .ci/gpu-device's
compute-sanitizer runs pick the fp16 cases. The CPU-side checks of the same kernels (compile,
emulation, layout, arguments) are tests/kernels/test_quant_cuda.py."""

from __future__ import annotations

import pytest
import torch

from kernels.specs import QuantLinearSpec
from tests.gpu.test_kernels_vs_cpu import ALL_DTYPES, TOLERANCE, cubin_cache, dtype_id
from tests.kernels.test_quant_cuda import SCALE_DTYPES, SHAPES, random_weight
from worker.cuda_quant import CudaQuantLinear, DequantScratch, QuantKernels

_KERNELS: dict[QuantLinearSpec, QuantKernels] = {}


@pytest.fixture(scope="module")
def backend():
    from worker.backends.cuda import CudaAttentionBackend

    return CudaAttentionBackend("cuda", cache=cubin_cache())


def cuda_module(backend, weight, bias, dtype) -> CudaQuantLinear:
    names = [str(d).removeprefix("torch.") for d in (dtype, weight.scales.dtype)]
    spec = QuantLinearSpec(names[0], names[1], weight.bits)
    if spec not in _KERNELS:
        _KERNELS[spec] = QuantKernels(backend, spec)
    n, k = weight.shape
    scratch = DequantScratch(n * k, dtype, backend.device)
    return CudaQuantLinear(weight, bias, dtype, backend.device, _KERNELS[spec], scratch)


def expected_output(weight, x, bias) -> torch.Tensor:
    """x @ W^T + b in float64 from the exact codes, zeros and scales."""
    group = torch.arange(weight.shape[1]) // weight.group_size
    dense = (weight.codes.double() - weight.zeros.double()[:, group]) * weight.scales.double()[:, group]
    y = x.double().cpu() @ dense.T
    return y if bias is None else y + bias.double().cpu()


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype) -> None:
    actual = actual.double().cpu()
    assert not actual.isnan().any(), "some output elements were never written"
    error = (actual - expected).abs().max().item()
    assert error <= TOLERANCE[dtype] * max(1.0, expected.abs().max().item()), f"max error {error:.3g}"


def case(shape, bits, scale, dtype, seed):
    n, k, group = shape
    weight = random_weight(n, k, group, bits, SCALE_DTYPES[scale], seed=seed)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(seed)).to(dtype) if n % 2 else None
    return weight, bias  # odd N: with a bias, even N: without


@pytest.mark.parametrize("scale", SCALE_DTYPES)
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=dtype_id)
def test_quant_gemv_matches_the_dequantized_product(backend, dtype, bits, scale):
    for index, shape in enumerate(SHAPES):
        weight, bias = case(shape, bits, scale, dtype, seed=index)
        module = cuda_module(backend, weight, bias, dtype)
        n, k, _ = shape
        for rows in range(1, 9):
            x = torch.randn(rows, k).to(dtype)
            y = torch.full((rows, n), float("nan"), dtype=dtype, device="cuda")
            module.gemv_into(y, x.cuda())
            assert_close(y, expected_output(weight, x, bias), dtype)
        # Rows of a wider buffer (x_stride > K), and a misaligned view (copied first).
        wide = torch.randn(3, k + 8).to(dtype).cuda()
        assert_close(module(wide[:, :k]), expected_output(weight, wide[:, :k], bias), dtype)
        assert_close(module(wide[:, 1 : k + 1]), expected_output(weight, wide[:, 1 : k + 1], bias), dtype)


@pytest.mark.parametrize("scale", SCALE_DTYPES)
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=dtype_id)
def test_quant_dequant_is_bitwise_the_cpu_dequantization_and_feeds_cublas(backend, dtype, bits, scale):
    for index, shape in enumerate(SHAPES):
        weight, bias = case(shape, bits, scale, dtype, seed=100 + index)
        module = cuda_module(backend, weight, bias, dtype)
        n, k, _ = shape
        out = torch.full((n, k), float("nan"), dtype=dtype, device="cuda")
        module.dequantize_into(out)
        assert torch.equal(out.cpu(), weight.dequantize(dtype))
        for rows in (9, 40):  # past the GEMV's rows: dequantize into the scratch, then cuBLAS
            x = torch.randn(rows, k).to(dtype)
            assert_close(module(x.cuda()), expected_output(weight, x, bias), dtype)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=dtype_id)
def test_quant_gemv_and_dequant_replay_in_a_cuda_graph(backend, dtype):
    """Both paths captured with static inputs, replayed on new values: what a decode graph does."""
    weight, bias = case((37, 1280, 128), 4, "s-f16", dtype, seed=5)
    module = cuda_module(backend, weight, bias, dtype)
    for rows in (3, 16):
        static_x = torch.randn(rows, 1280).to(dtype).cuda()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            module(static_x)  # warm-up outside capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_y = module(static_x)
        for seed in range(3):
            x = torch.randn(rows, 1280, generator=torch.Generator().manual_seed(seed)).to(dtype)
            static_x.copy_(x.cuda())
            graph.replay()
            torch.cuda.synchronize()
            if rows <= 8:  # the GEMV's reduction order is fixed: bitwise the eager launch
                assert torch.equal(static_y, module(static_x)), "graph replay differs from eager"
            assert_close(static_y, expected_output(weight, x, bias), dtype)
