"""The linear layers' kernel (kernels/cpu_gemm.c) and its weight layout (worker/cpu_weights.py):
panels hold exactly the weight (index math checked against a hand-written layout), and
pk_linear equals x W^T + b in float64 for fp32, bf16 and fp16 weights, every row count
around the register tile sizes, partial last panels, odd K, with and without bias, in every
ISA variant this CPU runs. Tied embeddings read rows back out of the panels."""

from __future__ import annotations

import pytest
import torch

from worker.cpu_weights import PANEL, PanelLinear, pack_panels, unpack_panels

WEIGHT_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# Variants whose bf16 linears multiply x rounded to bf16 (vdpbf16ps, AMX tdpbf16ps)
ROUNDS_X_TO_BF16 = ("avx512bf16", "avx512amx")


def test_panel_layout_is_the_documented_index_math():
    """Element (n, k) sits where cpu_gemm.c's file comment says, for both layouts."""
    n, k = 70, 5
    weight = torch.arange(n * k, dtype=torch.float32).view(n, k)
    panels, k_pad = pack_panels(weight, torch.float32)
    flat = panels.flatten()
    for row, col in [(0, 0), (3, 4), (63, 2), (64, 0), (69, 4)]:
        assert flat[(row // PANEL * k + col) * PANEL + row % PANEL] == weight[row, col]
    bf = weight.to(torch.bfloat16)
    panels, k_pad = pack_panels(bf, torch.bfloat16)
    assert k_pad == 6 and panels.shape == (2, 3, PANEL, 2)
    flat = panels.flatten()
    for row, col in [(0, 0), (3, 4), (63, 3), (64, 1), (69, 4)]:
        index = (row // PANEL * (k_pad // 2) + col // 2) * 2 * PANEL + row % PANEL * 2 + col % 2
        assert flat[index] == bf[row, col]
    assert flat[(69 // PANEL * 3 + 2) * 2 * PANEL + 69 % PANEL * 2 + 1] == 0  # the odd-K pad column
    assert flat.numel() == 128 * 6 and (flat.view(2, 3, PANEL, 2)[1, :, 6:, :] == 0).all()  # rows 70..127


@pytest.mark.parametrize("dtype", WEIGHT_DTYPES)
def test_unpack_inverts_pack(dtype):
    weight = torch.randn(130, 77).to(dtype)
    panels, _ = pack_panels(weight, dtype)
    assert torch.equal(unpack_panels(panels, 130, 77), weight)


@pytest.mark.parametrize("dtype", WEIGHT_DTYPES)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 13, 64])
@pytest.mark.parametrize("shape", [(64, 64), (200, 96), (130, 77), (1, 2), (300, 1030)])
def test_pk_linear_matches_float64(ops, dtype, rows, shape):
    n, k = shape
    gen = torch.Generator().manual_seed(n * 31 + k + rows)
    weight = torch.randn(n, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen) if rows % 2 else None
    x = torch.randn(rows, k, generator=gen)
    got = PanelLinear(ops, weight, bias, dtype)(x)
    # vdpbf16ps multiplies x rounded to bf16; every other path the fp32 x
    x_used = (
        x.to(torch.bfloat16).float() if dtype == torch.bfloat16 and ops.variant in ROUNDS_X_TO_BF16 else x
    )
    want = x_used.double() @ weight.double().T + (0 if bias is None else bias.double())
    scale = (x_used.double().abs() @ weight.double().abs().T).max().item()
    assert (got.double() - want).abs().max().item() <= 2e-6 * scale


@pytest.mark.parametrize("dtype", WEIGHT_DTYPES)
def test_a_row_alone_gives_the_bits_it_gives_in_a_batch(ops, dtype):
    """A one-row GEMM's tile spans more columns (cpu_gemm_tiles.c ROW1_SPAN) than a batch's, but each
    column is the same sum in the same order: decoding alone or beside other requests gives the
    same tokens. Three rows: below the AMX tiles' minimum, so every variant runs register tiles."""
    gen = torch.Generator().manual_seed(7)
    weight = torch.randn(200, 96, generator=gen).to(dtype)  # a partial last panel
    x = torch.randn(3, 96, generator=gen)
    layer = PanelLinear(ops, weight, None, dtype)
    batch = layer(x)
    for r in range(3):
        assert torch.equal(layer(x[r : r + 1]), batch[r : r + 1])


def test_pk_linear_with_odd_k_in_bf16(ops):
    """An odd K pads the bf16 panels with a zero column, and the layer pads x to match."""
    weight = torch.randn(96, 33).to(torch.bfloat16)
    x = torch.randn(5, 33)
    layer = PanelLinear(ops, weight, None, torch.bfloat16)
    got = layer(x)
    x_used = x.to(torch.bfloat16).float() if ops.variant in ROUNDS_X_TO_BF16 else x
    torch.testing.assert_close(got, x_used @ weight.float().T, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype", WEIGHT_DTYPES)
def test_rows_gathered_from_panels_are_the_weight_rows(ops, dtype):
    weight = torch.randn(200, 97).to(dtype)
    layer = PanelLinear(ops, weight, None, dtype)
    ids = torch.tensor([0, 199, 64, 63, 5, 5])
    assert torch.equal(layer.gather_rows(ids), weight[ids].float())


@pytest.mark.parametrize("dtype", WEIGHT_DTYPES)
def test_gather_rows_from_a_table(ops, dtype):
    from worker.cpu_weights import dtype_code

    table = torch.randn(50, 40).to(dtype)
    ids = torch.tensor([3, 49, 0, 3])
    out = torch.empty(4, 40)
    ops.gather_rows(dtype_code(dtype), out.data_ptr(), table.data_ptr(), ids.data_ptr(), 4, 40, 2)
    assert torch.equal(out, table[ids].float())
