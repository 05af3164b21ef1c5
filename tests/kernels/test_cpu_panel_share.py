"""Panels shared out between pk_linear's threads with stealing at the end (kernels/
cpu_panel_share.h): every panel runs exactly once whatever the timing, a thread done with its
share takes the slow thread's last panels (its runs stay a prefix of its share), and pk_linear's
output is the same bits with one thread or two, in every ISA variant this CPU runs (pk_mlp's:
test_cpu_mlp_amx.py)."""

from __future__ import annotations

import ctypes

import pytest
import torch

from kernels import cpu_build
from worker.cpu_weights import PanelLinear

STEAL_TRIES = 5  # a machine busy enough to park the fast thread for a whole try gets another


def share_out(ops, panels: int, threads: int, slow_ns: int = 0) -> tuple[int, list[int], list[int]]:
    runner, runs = (ctypes.c_int32 * panels)(*([-1] * panels)), (ctypes.c_int32 * panels)()
    used = ops.pk_panel_share_check(panels, threads, slow_ns, runner, runs)
    return used, list(runner), list(runs)


@pytest.mark.parametrize("threads", [1, 2, 3, 4])
@pytest.mark.parametrize("panels", [1, 2, 3, 7, 64, 1000])
def test_every_panel_runs_exactly_once(ops, panels, threads):
    used, runner, runs = share_out(ops, panels, threads)
    assert runs == [1] * panels
    assert all(0 <= t < used for t in runner)


def test_a_slow_thread_loses_its_last_panels_to_the_other(ops):
    if cpu_build.is_serial(ops.path):
        pytest.skip("these kernels were built without OpenMP: one thread, nothing to steal")
    panels = 40  # shares [0, 20) and [20, 40); thread 0 spends 2 ms on each panel it runs
    for _ in range(STEAL_TRIES):
        used, runner, runs = share_out(ops, panels, 2, slow_ns=2_000_000)
        assert used == 2 and runs == [1] * panels
        assert runner[20:] == [1] * 20  # thread 1's own share
        kept = runner[:20].count(0)
        assert runner[:20] == [0] * kept + [1] * (20 - kept)  # thread 0 ran a prefix; the rest was stolen
        if kept < 20:
            return
    pytest.fail(f"thread 1 stole none of thread 0's panels in {STEAL_TRIES} tries of ~40 ms each")


# the 0.5B's qkv at batch 1, o at 16, up and down at 64 (K 4,864: AMX K blocks, a panel alone
# pays), an odd K and a partial panel; then shared per (K block, row chunk) round: more rows than
# one AMX row chunk, down at a 256-token prompt, and 3 row chunks x 2 K blocks with a K tail for
# the register tiles and a partial panel
SHAPES = [(1, 1152, 896), (16, 896, 896), (64, 4864, 896), (64, 896, 4864), (64, 200, 97), (300, 256, 128)]
SHAPES += [(256, 896, 4864), (600, 200, 1061)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("rows", "n", "k"), SHAPES)
def test_one_thread_and_two_give_the_same_bits(ops, dtype, rows, n, k):
    gen = torch.Generator().manual_seed(rows * n + k)
    weight, x = torch.randn(n, k, generator=gen).to(dtype), torch.randn(rows, k, generator=gen)
    layer = PanelLinear(ops, weight, None, dtype)
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = layer(x)
        torch.set_num_threads(2)
        shared = [layer(x) for _ in range(3)]
    finally:
        torch.set_num_threads(saved)
    for y in shared:
        assert torch.equal(y, alone)
