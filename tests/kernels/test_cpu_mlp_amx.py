"""pk_mlp (kernels/cpu_gemm.c + cpu_gemm_amx.c): an MLP's gate/up GEMM, SiLU x up and down GEMM
in one AMX pass that writes the SiLU product once, as down's bf16 input. It must give the bits
of the three kernels it replaces in the decoder (pk_linear, silu_mul, pk_linear), so the oracle
is those kernels, themselves tested against float64 (test_cpu_gemm_amx.py), plus a float64
check of the whole MLP. Where the tiles do not apply it writes nothing and returns -3, and the
decoder runs the three kernels. The AMX tests skip, saying why, where this CPU or kernel runs no
tiles."""

from __future__ import annotations

import pytest
import torch

from worker.cpu_weights import PanelLinear

NOT_APPLICABLE = -3
MIN_ROWS = 128  # kernels/cpu_gemm_amx.h AMX_MLP_MIN_ROWS: fewer rows take the three kernels


@pytest.fixture
def amx(all_ops):
    if "avx512amx" not in all_ops:
        pytest.skip(f"this CPU or kernel does not run AMX tiles (variants here: {', '.join(all_ops)})")
    return all_ops["avx512amx"]


def _mlp(gen, d, inner, bias):
    gate_up = (torch.randn(2 * inner, d, generator=gen) / d**0.5).to(torch.bfloat16)
    down = (torch.randn(d, inner, generator=gen) / inner**0.5).to(torch.bfloat16)
    return gate_up, down, torch.randn(d, generator=gen) if bias else None


def _fused(ops, x, gate_up, down, bias, inner, threads=2):
    rows, d = x.shape
    gu, dn = PanelLinear(ops, gate_up, None, torch.bfloat16), PanelLinear(ops, down, bias, torch.bfloat16)
    y = torch.full((rows, d), float("nan"))
    bias_ptr = None if bias is None else dn.bias.data_ptr()
    # bf16 NaNs (0x7FC0): an element of down's input the pass did not write would show in y
    scratch = torch.full((ops.pk_mlp_scratch_bytes(rows, inner) // 2,), 0x7FC0, dtype=torch.int16)
    status = ops.pk_mlp(y.data_ptr(), x.data_ptr(), gu.panels.data_ptr(), dn.panels.data_ptr(), bias_ptr,
                        rows, d, inner, scratch.data_ptr(), threads)  # fmt: skip
    return status, y


def _three_kernels(ops, x, gate_up, down, bias, inner):
    wide = PanelLinear(ops, gate_up, None, torch.bfloat16)(x)
    act = torch.empty(x.shape[0], inner)
    ops.silu_mul(act.data_ptr(), wide.data_ptr(), x.shape[0], inner, 2)
    return PanelLinear(ops, down, bias, torch.bfloat16)(act)


@pytest.mark.parametrize("rows", [MIN_ROWS, MIN_ROWS + 1, MIN_ROWS + 17, 200, 600])  # 600: 3 chunks of 256
@pytest.mark.parametrize(
    "d,inner",
    [
        (64, 64),  # one gate panel: one thread's
        (96, 192),  # three gate panels split between two threads
        (1056, 128),  # K past one tile K block (AMX_KC 1024) in gate/up
        (32, 1088),  # down's K past one K block
    ],
)
def test_fused_mlp_gives_the_bits_of_the_three_kernels(amx, rows, d, inner):
    gen = torch.Generator().manual_seed(rows * 7919 + d * 31 + inner)
    gate_up, down, bias = _mlp(gen, d, inner, bias=rows % 2 == 1)
    x = torch.randn(rows, d, generator=gen)
    status, got = _fused(amx, x, gate_up, down, bias, inner)
    assert status == 0
    assert torch.equal(got, _three_kernels(amx, x, gate_up, down, bias, inner))
    # and both are the MLP: float64 of bf16(x) through the bf16 weights, the SiLU product rounded
    # to bf16 as down's input is
    g, u = (x.to(torch.bfloat16).double() @ gate_up.double().T).split(inner, dim=-1)
    act = (g * torch.sigmoid(g) * u).to(torch.bfloat16).double()
    want = act @ down.double().T + (0 if bias is None else bias.double())
    assert (got.double() - want).abs().max().item() <= 2e-2 * want.abs().max().item()


@pytest.mark.parametrize(
    "rows,d,inner",
    [
        (256, 896, 4864),  # the 0.5B's MLP at a 256-token prompt: one row chunk, down's K blocks
        (600, 96, 1088),  # 3 row chunks, 3 gate panels, down's K past one block
    ],
)
def test_one_thread_and_two_give_the_same_bits(amx, rows, d, inner):
    """Two threads share the gate/up panels and down's (K block, row chunk) rounds out with
    stealing (kernels/cpu_panel_share.h); whichever thread runs a panel, the bits are one thread's."""
    gen = torch.Generator().manual_seed(rows + d + inner)
    gate_up, down, bias = _mlp(gen, d, inner, bias=True)
    x = torch.randn(rows, d, generator=gen)
    status, alone = _fused(amx, x, gate_up, down, bias, inner, threads=1)
    assert status == 0 and not torch.isnan(alone).any()
    for _ in range(3):
        status, shared = _fused(amx, x, gate_up, down, bias, inner, threads=2)
        assert status == 0 and torch.equal(shared, alone)


@pytest.mark.parametrize(
    "rows,d,inner",
    [
        (MIN_ROWS - 1, 64, 64),  # too few rows: the three kernels stream the weights better
        (MIN_ROWS, 64, 96),  # inner not a multiple of a panel: gate and up panels would not pair
        (MIN_ROWS, 40, 64),  # K not a multiple of the tile step
    ],
)
def test_where_the_tiles_do_not_apply_nothing_is_written(amx, rows, d, inner):
    gen = torch.Generator().manual_seed(rows + d + inner)
    gate_up, down, bias = _mlp(gen, d, inner, bias=False)
    status, y = _fused(amx, torch.randn(rows, d, generator=gen), gate_up, down, bias, inner)
    assert status == NOT_APPLICABLE and torch.isnan(y).all()


def test_variants_without_tiles_decline(ops):
    """Every variant links pk_mlp; only the AMX one runs it (the decoder then takes the three
    kernels, which is how every other variant always ran)."""
    gen = torch.Generator().manual_seed(5)
    gate_up, down, bias = _mlp(gen, 64, 64, bias=False)
    status, y = _fused(ops, torch.randn(MIN_ROWS, 64, generator=gen), gate_up, down, bias, 64)
    if ops.variant == "avx512amx":
        assert status == 0 and not torch.isnan(y).any()
    else:
        assert status == NOT_APPLICABLE and torch.isnan(y).all()
