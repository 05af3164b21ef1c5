"""The AMX tile path of bf16 linears (kernels/cpu_gemm_amx.c, in the avx512amx variant): every
shape class the forward gives it (row counts from the 4-row threshold, around the 16-row tiles
and the 32-row blocks; K not a multiple of the 32-k tile step; N past the last full tile; fused
q|k|v of a GQA layer and gate|up) against float64 of the bf16-rounded x, and bit-exact where the
math is exact; the tiles' result equals the AVX-512 BF16 kernel's to fp32 rounding. Runs only
where this CPU and kernel run AMX; elsewhere each test skips saying why."""

from __future__ import annotations

import pytest
import torch

from worker.cpu_weights import PanelLinear

MIN_ROWS = 4  # kernels/cpu_gemm_amx.h AMX_MIN_ROWS: fewer rows take the AVX-512 register tiles


@pytest.fixture
def amx(all_ops):
    if "avx512amx" not in all_ops:
        pytest.skip(f"this CPU or kernel does not run AMX tiles (variants here: {', '.join(all_ops)})")
    return all_ops["avx512amx"]


def _bf16_reference(x, weight, bias):
    x16 = x.to(torch.bfloat16).double()
    want = x16 @ weight.double().T + (0 if bias is None else bias.double())
    scale = (x16.abs() @ weight.double().abs().T).max().item()
    return want, scale


@pytest.mark.parametrize("rows", [4, 5, 15, 16, 17, 31, 32, 33, 48, 97])
@pytest.mark.parametrize(
    "shape",
    [
        (64, 32),  # one panel, one tile step
        (70, 96),  # N tail inside the second panel's first 16 columns
        (130, 77),  # odd K: panels padded to 78, tiles take 64, the register tiles the last 14
        (200, 1030),  # K blocks and a tail; N ends mid-tile
        (48, 20),  # K under one tile step: no tiles at all
    ],
)
def test_tiles_match_float64_of_bf16_x(amx, rows, shape):
    n, k = shape
    gen = torch.Generator().manual_seed(rows * 1009 + n * 31 + k)
    weight = torch.randn(n, k, generator=gen).to(torch.bfloat16)
    bias = torch.randn(n, generator=gen) if rows % 2 else None
    x = torch.randn(rows, k, generator=gen)
    got = PanelLinear(amx, weight, bias, torch.bfloat16)(x)
    want, scale = _bf16_reference(x, weight, bias)
    assert (got.double() - want).abs().max().item() <= 2e-6 * scale


@pytest.mark.parametrize("rows", [4, 16, 33, 64])
def test_tiles_are_exact_where_the_math_is_exact(amx, rows):
    """Small integers: every product and partial sum is an integer below 2^24, so fp32 holds them
    exactly whatever the order of the additions; one wrong element, pair or tile offset shows."""
    gen = torch.Generator().manual_seed(rows)
    n, k = 150, 1090  # N and K tails, K blocks of the tiles, a register-tile K tail
    weight = torch.randint(-3, 4, (n, k), generator=gen).to(torch.bfloat16)
    x = torch.randint(-3, 4, (rows, k), generator=gen).float()
    got = PanelLinear(amx, weight, None, torch.bfloat16)(x)
    assert torch.equal(got.double(), x.double() @ weight.double().T)


@pytest.mark.parametrize(
    "name,out_features,in_features",
    [
        ("qkv of a GQA layer (14 heads, 2 KV heads, dim 64)", 896 + 2 * 128, 896),
        ("gate|up", 2 * 608, 224),
        ("down", 224, 608),
    ],
)
def test_fused_projections_agree_with_the_avx512_kernel(amx, all_ops, name, out_features, in_features):
    """The layer shapes of a 0.5B-class model (scaled down where only the count matters): the
    tiles and vdpbf16ps multiply the same bf16 products, so they differ by fp32 rounding only."""
    gen = torch.Generator().manual_seed(out_features)
    weight = torch.randn(out_features, in_features, generator=gen).to(torch.bfloat16)
    bias = torch.randn(out_features, generator=gen)
    x = torch.randn(40, in_features, generator=gen)
    got = PanelLinear(amx, weight, bias, torch.bfloat16)(x)
    want, scale = _bf16_reference(x, weight, bias)
    assert (got.double() - want).abs().max().item() <= 2e-6 * scale, name
    if "avx512bf16" in all_ops:
        other = PanelLinear(all_ops["avx512bf16"], weight, bias, torch.bfloat16)(x)
        assert (got - other).abs().max().item() <= 4e-6 * scale, name


def test_fewer_rows_than_a_tile_keep_the_register_tiles(amx, all_ops):
    """Under MIN_ROWS the AMX build runs the AVX-512 BF16 code: bit-identical results (batch-1 and
    batch-2 decode do not change)."""
    if "avx512bf16" not in all_ops:
        pytest.skip("the avx512bf16 variant is not loadable here to compare with")
    gen = torch.Generator().manual_seed(7)
    weight = torch.randn(300, 1030, generator=gen).to(torch.bfloat16)
    for rows in range(1, MIN_ROWS):
        x = torch.randn(rows, 1030, generator=gen)
        got = PanelLinear(amx, weight, None, torch.bfloat16)(x)
        assert torch.equal(got, PanelLinear(all_ops["avx512bf16"], weight, None, torch.bfloat16)(x)), rows
