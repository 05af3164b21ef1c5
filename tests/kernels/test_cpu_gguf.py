"""The GGUF block kernels (kernels/cpu_gguf.c, driven by worker/cpu_gguf_linear.py), in every ISA
variant this CPU runs, against llama.cpp's own numpy reference (gguf.quants):

  * each block decoder equals gguf.quants.dequantize bit for bit, on blocks encoded from dense
    weights (tests/gguf_blocks.py: gguf.quants.quantize where it encodes the type) and on random
    bytes (every bit pattern of codes, sub-block scales and mins; fp16 super-scales finite);
  * the linear is the documented int8-activation math: activations become int8 codes per row and
    block of 32 (xs = absmax / 127, round to nearest even), and the output equals x_used W^T in
    float64 (x_used = xq xs, W dequantized by gguf.quants) up to fp32 accumulation round-off; so
    its error against the exact layer is the activation rounding alone (<= xs / 2 per input);
  * the int8 math holds at every row count in the variants with AVX-512 VNNI and no AMX
    (avx512bf16, avx512vnni): from VNNI_MIN_ROWS on, the blocks regrouped once per call into
    strips of 16 weight rows for vpdpbusd (cpu_gguf_vnni.c: per-type strip decoders for Q4_0,
    Q8_0, Q4_K and Q6_K, the generic lanes decoder for the rest and for strips that cross
    parts or end past N);
  * from a variant's bf16 row count on (the avx512amx variant: TILE_MIN_ROWS, on its AMX tiles,
    cpu_gguf_amx.c; avx512 and avx2: PANEL_MIN_ROWS, blocks decoded into bf16 panel chunks for
    the register tiles, cpu_gguf_panels.c; generic / neon and the VNNI variants: never) W is rounded
    to bf16 (from gguf.quants' value) and accumulated in fp32, so the output equals
    x_used W_bf16^T in float64 up to fp32 round-off, x_used being x rounded to bf16 where the
    variant multiplies with vdpbf16ps / tiles, x as is elsewhere; below it the integer path;
  * fused parts of different types (Q4_K_M's Q4_K q|k with a Q6_K v), bias, odd M and N tails.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf.constants import GGML_QUANT_SIZES
from gguf.constants import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize

from tests.gguf_blocks import encode
from worker.cpu_gguf_linear import NATIVE_TYPES, GgufLinear, gguf_linear
from worker.quant.gguf_weight import GgufBlockWeight

TYPES = [T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q4_K, T.Q5_K, T.Q6_K]
# byte offsets of each block's fp16 super-scales (d, and m / dmin where the type has one)
F16_FIELDS = {
    T.Q8_0: [0],
    T.Q4_0: [0],
    T.Q4_1: [0, 2],
    T.Q5_0: [0],
    T.Q5_1: [0, 2],
    T.Q4_K: [0, 2],
    T.Q5_K: [0, 2],
    T.Q6_K: [208],
}
TILE_MIN_ROWS = 4  # kernels/cpu_gguf.h GG_TILE_MIN_ROWS
PANEL_MIN_ROWS = 8  # kernels/cpu_gguf.h GG_PANEL_MIN_ROWS, in the x86 variants from avx2 up
PANEL_VARIANTS = {"avx512", "avx2"}
VNNI_MIN_ROWS = 4  # kernels/cpu_gguf.h GG_VNNI_MIN_ROWS, in the variants with AVX-512 VNNI and no AMX
BF16_X = {"avx512amx", "avx512bf16"}  # variants that round x to bf16 to multiply (vdpbf16ps, tiles)
FP32_SLACK = 2.0**-18  # fp32 rounding of per-block scale products and of the block-sum accumulation


def random_blocks(qtype: T, n: int, k: int, rng: np.random.Generator, scale: float = 0.01) -> GgufBlockWeight:
    """Every code / sub-scale byte uniform; the fp16 super-scales finite (random bytes would
    include inf / NaN, which no file holds and no decoder promises anything for)."""
    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (n, k // block, size), dtype=np.uint8)
    for offset in F16_FIELDS[qtype]:
        d = (rng.standard_normal((n, k // block)) * scale).astype(np.float16)
        raw[..., offset : offset + 2] = d.view(np.uint8).reshape(n, k // block, 2)
    return GgufBlockWeight(torch.from_numpy(raw.reshape(n, -1).copy()), int(qtype), (n, k))


def make_weight(qtype: T, n: int, k: int, rng: np.random.Generator) -> GgufBlockWeight:
    return encode(torch.from_numpy((rng.standard_normal((n, k)) * 0.05).astype(np.float32)), qtype)


def oracle(weight: GgufBlockWeight) -> np.ndarray:
    n, k = weight.shape
    return dequantize(weight.data.numpy(), T(weight.ggml_type)).reshape(n, k).astype(np.float32)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("source", ["random-bytes", "quantized"])
def test_block_decoders_equal_gguf_dequantize_bit_for_bit(ops, qtype, source):
    rng = np.random.default_rng(int(qtype))
    weight = (random_blocks if source == "random-bytes" else make_weight)(qtype, 40, 512, rng)
    ids = torch.tensor([39, 0, 7, 7, 22])
    ours = GgufLinear(ops, [weight], None).gather_rows(ids).numpy()
    want = oracle(weight)[ids.numpy()]
    assert np.array_equal(ours.view(np.uint32), want.view(np.uint32))


def emulate(x: torch.Tensor, w: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """(float64 result of the documented int8-activation math, float64 magnitude of its terms)."""
    m, k = x.shape
    xb = x.view(m, k // 32, 32)
    amax = xb.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))  # fp32, as the kernel
    xq = torch.round(xb * inv)  # lrintf: to nearest even, as torch.round
    x_used = (xq.double() * (amax / 127.0).double()).view(m, k)
    wd = torch.from_numpy(w).double()
    return x_used @ wd.T, x_used.abs() @ wd.abs().T


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize(
    "m, n, k",
    [
        (1, 67, 512),
        (VNNI_MIN_ROWS, 67, 512),
        (5, 19, 256),
        (7, 130, 768),
        (17, 19, 256),
        (33, 130, 768),
        (100, 32, 256),
    ],
)
def test_linear_is_the_int8_activation_math(ops, qtype, m, n, k):
    """One row and VNNI_MIN_ROWS (the first on the VNNI strips where they run); odd row counts (a
    tile of 8 cut short); N tails (a strip of 16 cut short: the lanes decoder); 768 / 512 (whole
    strips of one part: the per-type strip decoders)."""
    if m >= (bf16_min_rows(ops) or m + 1):
        pytest.skip(f"{m} rows take the bf16 path in {ops.variant} (test_many_rows_are_the_bf16_math)")
    rng = np.random.default_rng(m * 1000 + n + int(qtype))
    weight = make_weight(qtype, n, k, rng)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(n))
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(k + m)) * 3
    x[0, :32] = 0  # an all-zero activation block: scale 0, codes 0
    y = GgufLinear(ops, [weight], bias)(x).double()
    want, magnitude = emulate(x, oracle(weight))
    error = (y - bias.double() - want).abs()
    assert (error <= FP32_SLACK * magnitude + 1e-6).all(), f"max error {error.max():.3g}"
    exact = x.double() @ torch.from_numpy(oracle(weight)).double().T
    assert not torch.allclose(want, exact, rtol=0, atol=1e-9)  # the test sees the activation rounding


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_random_block_bytes_are_the_int8_math(ops, qtype):
    """Every bit pattern of codes, sub-block scales and mins (random bytes, fp16 scales finite),
    through whole strips of 16 weight rows and the tile of 8 rows where the VNNI strips run."""
    m, n, k = 9, 48, 512
    if m >= (bf16_min_rows(ops) or m + 1):
        pytest.skip(f"{m} rows take the bf16 path in {ops.variant} (test_many_rows_are_the_bf16_math)")
    weight = random_blocks(qtype, n, k, np.random.default_rng(int(qtype) + 7))
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(int(qtype)))
    y = GgufLinear(ops, [weight], None)(x).double()
    want, magnitude = emulate(x, oracle(weight))
    error = (y - want).abs()
    assert (error <= FP32_SLACK * magnitude + 1e-6).all(), f"max error {error.max():.3g}"


def bf16_min_rows(ops) -> int | None:
    """Rows from which `ops` takes the bf16 path; None: the integer path at every row count."""
    if ops.variant == "avx512amx":
        return TILE_MIN_ROWS
    return PANEL_MIN_ROWS if ops.variant in PANEL_VARIANTS else None


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize(
    "m, n, k", [(None, 67, 512), (17, 19, 256), (33, 130, 768), (100, 32, 256), (9, 70, 2304)]
)
def test_many_rows_are_the_bf16_math(ops, qtype, m, n, k):
    """The first bf16 row count and odd ones (a 16-row tile half empty, a register tile cut
    short), N tails (a panel of weight rows cut short), K over several panel chunks (2304: two
    of 1024 and one of 256) and pieces, an all-zero activation block; the integer path's int8
    math would miss the bound (asserted, so the test sees which path ran)."""
    if bf16_min_rows(ops) is None:
        pytest.skip(f"{ops.variant} runs the int8 math at every row count (VNNI strips or the integer path)")
    m = m or bf16_min_rows(ops)
    rng = np.random.default_rng(m * 1000 + n + int(qtype))
    weight = make_weight(qtype, n, k, rng)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(n))
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(k + m)) * 3
    x[0, :32] = 0
    y = GgufLinear(ops, [weight], bias)(x).double() - bias.double()
    x_used = x.to(torch.bfloat16).double() if ops.variant in BF16_X else x.double()
    w16 = torch.from_numpy(oracle(weight)).to(torch.bfloat16).double()
    want, magnitude = x_used @ w16.T, x_used.abs() @ w16.abs().T
    error = (y - want).abs()
    assert (error <= FP32_SLACK * magnitude + 1e-6).all(), f"max error {error.max():.3g}"
    int8_math, _ = emulate(x, oracle(weight))
    assert not ((int8_math - want).abs() <= FP32_SLACK * magnitude + 1e-6).all()
    rows_below = bf16_min_rows(ops) - 1
    below = GgufLinear(ops, [weight], bias)(x[:rows_below]).double() - bias.double()
    assert torch.allclose(below, int8_math[:rows_below], rtol=0, atol=1e-4)  # integer path


def test_fused_parts_of_different_types(ops):
    rng = np.random.default_rng(3)
    parts = [
        make_weight(T.Q4_K, 70, 512, rng),
        make_weight(T.Q6_K, 33, 512, rng),
        make_weight(T.Q8_0, 5, 512, rng),
    ]
    fused = GgufLinear(ops, parts, None)
    for rows in (2, 37):  # 37: the strips / panels / tiles path, whose strips and panels cross the parts
        x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows))
        y = fused(x)
        alone = torch.cat([GgufLinear(ops, [p], None)(x) for p in parts], dim=1)
        assert y.shape == (rows, 108) and torch.equal(y, alone)
    assert fused.resident_bytes == sum(p.packed_bytes for p in parts)


def test_types_without_a_kernel_become_panels(ops):
    rng = np.random.default_rng(4)
    dense = (rng.standard_normal((16, 64)) * 0.1).astype(np.float32)
    other = GgufBlockWeight(torch.from_numpy(quantize(dense, T.BF16).view(np.uint8)), int(T.BF16), (16, 64))
    assert T.BF16 not in NATIVE_TYPES
    linear = gguf_linear(ops, [other], None, torch.float32)
    assert not isinstance(linear, GgufLinear)
    x = torch.randn(2, 64)
    torch.testing.assert_close(linear(x), x @ other.dequantize().T, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="GgufLinear takes"):
        GgufLinear(ops, [other], None)


def test_the_kernel_refuses_shapes_the_blocks_cannot_hold(ops):
    weight = make_weight(T.Q4_0, 4, 64, np.random.default_rng(5))
    x = torch.randn(1, 48)
    bad = GgufLinear(ops, [weight], None)
    bad.in_features = 48  # K not a whole number of blocks
    with pytest.raises(RuntimeError, match="gg_linear failed"):
        bad(x)
