"""kernels/lora_sgmv.cu's index math, emulated on the CPU block by block and thread by thread
as the source decomposes the work (the GPU run is for a machine with one): every (row, rank
index) of an adapted row is computed exactly once by the shrink, every (row, column) exactly
once by the expand, base-model rows (slot -1) and out-of-range slots are left alone, and the
result equals x · Aᵀ · Bt per row in torch. NVRTC compiles the kernels in test_compile.py."""

from __future__ import annotations

import re

import torch

from kernels.specs import KERNEL_DIR, LORA_EXPAND_THREADS, LORA_SHRINK_WARPS, lora_grids


def test_launch_constants_match_the_source():
    source = (KERNEL_DIR / "lora_sgmv.cu").read_text()
    assert int(re.search(r"kShrinkWarps = (\d+);", source)[1]) == LORA_SHRINK_WARPS
    assert int(re.search(r"kExpandThreads = (\d+);", source)[1]) == LORA_EXPAND_THREADS


def emulate(x, row_slot, a_tables, bt_tables, col, n, y):
    """Both kernels' grids as the source walks them; returns (t, shrink hits, expand hits)."""
    rows, k = x.shape
    ranks = [a.shape[0] for a in a_tables]
    max_rank = max(ranks)
    t = torch.zeros(rows, max_rank)
    shrink_hits = torch.zeros(rows, max_rank, dtype=torch.int64)
    expand_hits = torch.zeros(rows, n, dtype=torch.int64)
    shrink_grid, expand_grid = lora_grids(rows, max_rank, n)
    for r in range(shrink_grid[0]):
        for b in range(shrink_grid[1]):
            for thread in range(LORA_SHRINK_WARPS * 32):
                slot = int(row_slot[r])
                if slot < 0 or slot >= len(a_tables):
                    continue
                warp, lane = divmod(thread, 32)
                j = b * LORA_SHRINK_WARPS + warp
                if j >= ranks[slot]:
                    continue
                partial = sum(x[r, i] * a_tables[slot][j, i] for i in range(lane, k, 32))
                t[r, j] += partial  # the butterfly sums the 32 lanes' partials
                if lane == 0:
                    shrink_hits[r, j] += 1
    for r in range(expand_grid[0]):
        for b in range(expand_grid[1]):
            for i in range(LORA_EXPAND_THREADS):
                slot = int(row_slot[r])
                c = b * LORA_EXPAND_THREADS + i
                if slot < 0 or slot >= len(bt_tables) or c >= n:
                    continue
                y[r, col + c] += sum(t[r, j] * bt_tables[slot][j, c] for j in range(ranks[slot]))
                expand_hits[r, c] += 1
    return t, shrink_hits, expand_hits


def test_every_output_once_and_equal_to_torch():
    g = torch.Generator().manual_seed(0)
    rows, k, n, col = 5, 40, 150, 7  # n past one expand block, k past one warp's stride
    ranks = [3, 6]
    a_tables = [torch.randn(r, k, generator=g) for r in ranks]
    bt_tables = [torch.randn(r, n, generator=g) for r in ranks]
    x = torch.randn(rows, k, generator=g)
    row_slot = torch.tensor([1, -1, 0, 1, 2])  # a base row, and a slot past num_slots
    y = torch.randn(rows, col + n + 3, generator=g)
    expected = y.clone()
    for r, slot in enumerate(row_slot.tolist()):
        if 0 <= slot < len(a_tables):
            expected[r, col : col + n] += (x[r] @ a_tables[slot].T) @ bt_tables[slot]
    t, shrink_hits, expand_hits = emulate(x, row_slot, a_tables, bt_tables, col, n, y)
    for r, slot in enumerate(row_slot.tolist()):
        adapted = 0 <= slot < len(a_tables)
        rank = ranks[slot] if adapted else 0
        assert shrink_hits[r, :rank].eq(1).all() and shrink_hits[r, rank:].eq(0).all(), r
        assert expand_hits[r].eq(1 if adapted else 0).all(), r
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)
