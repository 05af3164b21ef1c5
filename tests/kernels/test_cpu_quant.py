"""The quantized linear kernel (kernels/cpu_quant.c, packed by worker/cpu_quant_weights.py) does
the math its file comment states, in every ISA variant this CPU runs:

  * activations become int16 codes per row and block of B = gcd(group, 128) inputs, scale
    xs = absmax / 32767, round to nearest even; the kernel's output equals that emulated in
    float64 up to fp32 round-off of the per-block fixup;
  * hence the error against the exact layer x W^T (W dequantized, float64) is bounded, for every
    output, by the activation rounding alone: |dy[n]| <= sum_b xs_b / 2 * sum_{k in b} |W[n, k]|
    (plus fp32 round-off). That is the per-layer error the model-level tolerances of
    tests/worker/test_quantized.py start from: at most 0.5 / 32767 = 1.5e-5 of a block's
    largest activation per input; on gaussian inputs ~3e-5 of max |y| (rounding errors of
    std xs / sqrt(12) summed like the products themselves, xs ~ 3 rms(x) / 32767).
"""

from __future__ import annotations

import math

import pytest
import torch

from worker.cpu_quant_weights import ACTIVATION_BLOCK, QuantLinear
from worker.quant.activations import quantize_int8_tokens
from worker.quant.weight import QuantizedWeight

FP32_SLACK = 2.0**-20  # a few fp32 roundings of the block sums, relative to their magnitude


def random_weight(n: int, k: int, bits: int, group: int, dtype: torch.dtype, gen) -> QuantizedWeight:
    top = 1 << bits
    codes = torch.randint(0, top, (n, k), generator=gen).to(torch.uint8)
    scales = (0.01 + 0.05 * torch.rand(n, k // group, generator=gen)).to(dtype)
    zeros = torch.randint(0, top + 1, (n, k // group), generator=gen).to(torch.uint8)  # GPTQ v1 may reach 2^b
    return QuantizedWeight(codes, scales, zeros, bits, group)


def emulate(x: torch.Tensor, weight: QuantizedWeight, block: int):
    """(float64 result of the documented int16 math, float64 magnitude of its terms)."""
    m, k = x.shape
    xb = x.view(m, k // block, block)
    scale = xb.abs().amax(-1, keepdim=True) / 32767.0  # fp32, as the kernel computes it
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    xq = torch.round(xb / scale).clamp(-32767, 32767)  # lrintf: round half to even
    x_used = (xq.double() * scale.double()).view(m, k)  # exactly what the integer dot multiplies
    group = weight.group_size
    zeros = weight.zeros.double().repeat_interleave(group, 1)
    scales = weight.scales.double().repeat_interleave(group, 1)
    w = (weight.codes.double() - zeros) * scales
    terms = (weight.codes.double() + zeros) * scales  # the two integer sums the fixup subtracts
    x_abs = xq.abs().view(m, k).double() * scale.view(m, -1).double().repeat_interleave(block, 1)
    return x_used @ w.T, x_abs @ terms.T


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "n, k, group",
    [(70, 128, 32), (130, 256, 128), (96, 384, 384), (64, 192, 96), (8, 64, 64)],  # partial panels
)
def test_pq_linear_is_the_int16_activation_math(ops, bits, dtype, n, k, group):
    gen = torch.Generator().manual_seed(n * 1000 + k + group + bits)
    weight = random_weight(n, k, bits, group, dtype, gen)
    block = math.gcd(group, ACTIVATION_BLOCK)
    bias = torch.randn(n, generator=gen)
    layer = QuantLinear(ops, weight, bias)
    assert layer.block == block
    for rows in (1, 2, 5, 6, 7, 13):
        x = torch.randn(rows, k, generator=gen)
        if rows == 5:  # one-signed activations with an outlier: the zero-point term cancels most
            x = x.abs() + 1.0
            x[:, 3] = 40.0
        got = layer(x).double() - bias.double()
        emulated, magnitude = emulate(x, weight, block)
        assert ((got - emulated).abs() <= FP32_SLACK * magnitude + 1e-30).all(), (rows, ops.variant)
        dense = weight.dequantize(torch.float64)
        exact = x.double() @ dense.T
        xs = x.view(rows, k // block, block).abs().amax(-1).double() / 32767  # [rows, blocks]
        w_abs = dense.abs().view(n, k // block, block).sum(-1)  # [n, blocks]
        bound = 0.5 * xs @ w_abs.T + FP32_SLACK * magnitude
        assert ((got - exact).abs() <= bound).all(), (rows, ops.variant)


def test_a_layer_is_within_1e_4_of_the_dequantized_one(ops):
    """docs/ARCHITECTURE.md's claim, on a model-like layer (gaussian inputs, 4-bit, group 128)."""
    gen = torch.Generator().manual_seed(1)
    weight = random_weight(512, 512, 4, 128, torch.float16, gen)
    x = torch.randn(4, 512, generator=gen)
    got = QuantLinear(ops, weight, None)(x).double()
    exact = x.double() @ weight.dequantize(torch.float64).T
    assert (got - exact).abs().max() <= 1e-4 * exact.abs().max()


TILE_MIN_ROWS = 8  # kernels/cpu_quant.c PQ_TILE_MIN_ROWS


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n, k, group", [(70, 128, 64), (130, 256, 128), (40, 384, 128), (64, 192, 32)])
def test_amx_tiles_are_the_integer_path_bit_for_bit(all_ops, bits, dtype, n, k, group):
    """The avx512amx variant's int8 tiles (kernels/cpu_quant_amx.c: the int16 codes split into
    bytes, exact int32 per block, the same fp32 fixup in block order) against the AVX-512 VNNI
    integer path: equal bits from TILE_MIN_ROWS rows on, odd row counts and N tails included;
    group 32 (blocks shorter than a 64-k tile step) keeps the integer path there."""
    if "avx512amx" not in all_ops or "avx512bf16" not in all_ops:
        pytest.skip(f"needs the avx512amx and avx512bf16 variants (this CPU runs {', '.join(all_ops)})")
    gen = torch.Generator().manual_seed(n + k + group + bits)
    weight = random_weight(n, k, bits, group, dtype, gen)
    bias = torch.randn(n, generator=gen)
    tiles = QuantLinear(all_ops["avx512amx"], weight, bias)
    vnni = QuantLinear(all_ops["avx512bf16"], weight, bias)
    for rows in (TILE_MIN_ROWS, 17, 33):
        x = torch.randn(rows, k, generator=gen) * 4
        x[1] = x[1].abs() + 1.0  # one-signed: the zero-point term cancels most of the sum
        assert torch.equal(tiles(x), vnni(x)), (rows, bits, dtype)


def w8a8_weight(n: int, k: int, gen) -> QuantizedWeight:
    """A compressed-tensors W8A8 layer as it decodes: int8 codes + 128, one fp32 scale per row."""
    codes = torch.randint(0, 256, (n, k), generator=gen).to(torch.uint8)
    scales = 0.001 + 0.01 * torch.rand(n, 1, generator=gen)
    return QuantizedWeight(codes, scales, torch.full((n, 1), 128, dtype=torch.uint8), 8, k, act_bits=8)


def w8a8_exact(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor) -> torch.Tensor:
    """worker/quant/activations.py's formula in torch: int8 codes per row, their sum with the
    signed weights in int64 (exact), then the kernels' one fp32 expression bias + sum * (s xs)."""
    codes, scales = quantize_int8_tokens(x)
    sums = codes.long() @ (weight.codes.long() - 128).T
    return bias + sums.float() * (weight.scales.float().T * scales)


@pytest.mark.parametrize("n, k", [(70, 128), (130, 256), (64, 192), (200, 896), (8, 64), (96, 100)])
def test_w8a8_is_int8_activations_per_token_exactly(ops, n, k):
    """act_bits 8 (W8A8): each row's inputs become int8 codes with absmax / 127 (the rounding the
    compressed-tensors library's quantize gives for that scale), and the layer's output is the
    exact integer product scaled once: equal bits on every variant (VNNI vpdpbusd, the int16
    path's code, the AMX int8 tiles from TILE_MIN_ROWS rows: K % 64 == 0 only), odd row counts,
    N tails, a row of zeros and rows that clip at +-127 included."""
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import quantize

    gen = torch.Generator().manual_seed(n * 7 + k)
    weight = w8a8_weight(n, k, gen)
    bias = torch.randn(n, generator=gen)
    layer = QuantLinear(ops, weight, bias)
    assert layer.block == k
    args = QuantizationArgs(num_bits=8, type="int", strategy="token", symmetric=True, dynamic=True)
    for rows in (1, 2, 5, 6, 7, 13, TILE_MIN_ROWS, 17, 33, 64):
        x = torch.randn(rows, k, generator=gen) * 3
        x[0, : k // 2] = 0.0
        if rows > 2:
            x[2] = 0.0  # no scale: codes 0, output = bias
        codes, scales = quantize_int8_tokens(x)
        library = quantize(x, scales, torch.zeros_like(scales), args)  # the library's rounding and clamp
        assert torch.equal(codes.float(), library), rows
        assert torch.equal(layer(x), w8a8_exact(x, weight, bias)), (rows, ops.variant)
    with pytest.raises(ValueError, match="8-bit weights with one scale per output channel"):
        scales, zeros = weight.scales.repeat(1, 2), weight.zeros.repeat(1, 2)
        halves = QuantizedWeight(weight.codes, scales, zeros, 8, k // 2, act_bits=8)
        QuantLinear(ops, halves, None)
