"""The greedy LM head (kernels/cpu_gemm.c pk_linear_argmax, cpu_lane_argmax.h): the argmax of
pk_linear's y, computed panel by panel without writing y. Its ids are torch.argmax of
pk_linear's own logits on every variant this CPU runs (AMX tiles from 4 bf16 rows, the register
tiles, the batch-1 GEMV), every panel dtype and shape class (N ending mid-panel, K tails past
the tiles, odd K in bf16, bias), and under torch.argmax's rules: the first of equal maxima (ties
inside a lane, across lanes, panels and the threads' panel ranges) and the first NaN, whatever
order the panels are folded in (a thread that steals takes another's panels from the back)."""

from __future__ import annotations

import ctypes

import pytest
import torch

from worker.cpu_weights import PANEL_DTYPES, PanelLinear

ROWS = [1, 3, 4, 17, 64]
SHAPES = [
    (64, 32),  # one panel
    (1000, 96),  # 16 panels, N ends mid-panel
    (4099, 77),  # odd K (bf16 pads it), N one past a panel
    (300, 1030),  # K past the tiles' 1024-row block and a register-tile K tail
]


def _weights(n, k, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=gen).to(dtype), torch.randn(n, generator=gen), gen


@pytest.mark.parametrize("dtype", PANEL_DTYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("shape", SHAPES)
def test_ids_are_torch_argmax_of_pk_linears_logits(ops, dtype, rows, shape):
    n, k = shape
    weight, bias, gen = _weights(n, k, dtype, rows * 7919 + n * 31 + k)
    head = PanelLinear(ops, weight, bias if rows % 2 else None, dtype)
    x = torch.randn(rows, k, generator=gen)
    assert head.argmax(x).tolist() == head(x).argmax(dim=-1).tolist()


@pytest.mark.parametrize("dtype", PANEL_DTYPES)
@pytest.mark.parametrize("rows", [1, 5, 33])
def test_ties_go_to_the_first_column(ops, dtype, rows):
    """Every weight row is one of three patterns, so each row's maximum is held by ~1/3 of the
    4,000 columns (the same bits: a column's sum does not depend on where it sits); the answer
    is the first of them, whichever lane, panel or thread holds it."""
    n, k = 4000, 64
    gen = torch.Generator().manual_seed(rows)
    patterns = torch.randn(3, k, generator=gen)
    weight = patterns[torch.randint(0, 3, (n,), generator=gen)].to(dtype)
    head = PanelLinear(ops, weight, None, dtype)
    x = torch.randn(rows, k, generator=gen)
    logits = head(x)
    assert (logits == logits.max(dim=-1, keepdim=True).values).sum(dim=-1).min() > 100, "many ties"
    assert head.argmax(x).tolist() == logits.argmax(dim=-1).tolist()


@pytest.mark.parametrize("dtype", PANEL_DTYPES)
@pytest.mark.parametrize("rows", [1, 4, 20])
def test_nan_wins_and_the_first_nan_is_the_answer(ops, dtype, rows):
    """inf x 0 makes a column NaN in the rows whose x[0] is 0: torch.argmax picks the first NaN
    column over any number; rows without a NaN keep their largest value. A row of -inf only (a
    -inf bias) gives column 0."""
    n, k = 3000, 64
    weight, bias, gen = _weights(n, k, dtype, rows + 5)
    weight[1700, 0] = float("inf")
    weight[2900, 0] = float("inf")
    x = torch.randn(rows, k, generator=gen)
    x[::2, 0] = 0.0  # even rows: columns 1700 and 2900 are NaN
    head = PanelLinear(ops, weight, None, dtype)
    logits = head(x)
    assert logits[0, 1700].isnan() and not logits[1:2, 1700].isnan().any()
    want = logits.argmax(dim=-1).tolist()
    assert want[0] == 1700
    assert head.argmax(x).tolist() == want
    weight[1700, 0] = weight[2900, 0] = 0.0
    all_minus_inf = PanelLinear(ops, weight, torch.full((n,), float("-inf")), dtype)
    assert all_minus_inf.argmax(x).tolist() == [0] * rows


@pytest.mark.parametrize("order", ["ascending", "descending", "shuffled"])
def test_the_lanes_answer_does_not_depend_on_the_panel_order(ops, order):
    """The fold alone (pk_lane_argmax_check), panels taken in any order: ties (values drawn from
    a few levels, so each row's maximum recurs across lanes and panels), NaN columns, -inf rows
    and a last panel that ends mid-way all give torch.argmax's answer."""
    rows, n, panels = 9, 1000, 16
    gen = torch.Generator().manual_seed(3)
    y = torch.randint(0, 5, (rows, panels * 64), generator=gen).float()
    y[2, 700] = y[2, 130] = y[2, 999] = float("nan")
    y[3] = float("-inf")
    y[4, 640:] = 100.0  # past n on the last panel's tail, and ties from 640 on
    y[4, 1000:] = 1000.0  # columns >= n never count
    perm = {"ascending": list(range(panels)), "descending": list(range(panels))[::-1]}
    perm["shuffled"] = torch.randperm(panels, generator=gen).tolist()
    order_arr = (ctypes.c_int64 * panels)(*perm[order])
    ids = torch.empty(rows, dtype=torch.int64)
    status = ops.pk_lane_argmax_check(y.data_ptr(), panels * 64, rows, n, order_arr, panels, ids.data_ptr())
    assert status == 0
    assert ids.tolist() == y[:, :n].argmax(dim=-1).tolist()
