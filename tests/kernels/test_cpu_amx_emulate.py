"""The software tiles (kernels/cpu_amx_emulate.c) that run the avx512amx kernels' tests on CPUs
without AMX, against the instructions' definitions computed here in torch: tdpbf16ps multiplies a
16 x 32 bf16 A by B's 16 k pairs x 16 columns (pairs interleaved in each B row) into fp32; the
int8 products take 4 bytes of k per int32, each operand signed or unsigned as the instruction
names it; loads and stores move the configured rows x bytes only, and past them a tile reads 0.
A tile used before its configuration aborts, as the hardware would fault."""

from __future__ import annotations

import ctypes
import subprocess
import sys

import pytest
import torch

from kernels import cpu_build
from tests.cpu_kernels import emulated_amx_library

TILES = 8


@pytest.fixture(scope="module")
def emu():
    library = emulated_amx_library(cpu_build.compiler_command())
    if library is None:
        pytest.skip("the emulated AMX build needs a C compiler and the avx512amx variant's AVX-512 BF16 code")
    lib = ctypes.CDLL(str(library))
    p, i, s = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t
    for name, args in {
        "pk_emu_loadconfig": (p,),
        "pk_emu_release": (),
        "pk_emu_zero": (i,),
        "pk_emu_loadd": (i, p, s),
        "pk_emu_stored": (i, p, s),
        "pk_emu_dpbf16ps": (i, i, i),
        "pk_emu_dpb": (i, i, i, i, i),
    }.items():
        getattr(lib, name).argtypes, getattr(lib, name).restype = args, None
    return lib


def configure(lib, shapes: dict[int, tuple[int, int]]) -> None:
    """tile -> (rows, bytes per row); the other tiles stay unconfigured."""
    config = bytearray(64)
    config[0] = 1
    for tile, (rows, colsb) in shapes.items():
        config[16 + 2 * tile : 18 + 2 * tile] = colsb.to_bytes(2, "little")
        config[48 + tile] = rows
    lib.pk_emu_loadconfig(ctypes.create_string_buffer(bytes(config), 64))


def load(lib, tile: int, t: torch.Tensor) -> None:
    t = t.contiguous()
    lib.pk_emu_loadd(tile, t.data_ptr(), t.stride(0) * t.element_size())


def store(lib, tile: int, like: torch.Tensor) -> torch.Tensor:
    out = torch.zeros_like(like)
    lib.pk_emu_stored(tile, out.data_ptr(), out.stride(0) * out.element_size())
    return out


def test_tdpbf16ps_is_the_pair_interleaved_product(emu):
    gen = torch.Generator().manual_seed(0)
    configure(emu, {t: (16, 64) for t in range(TILES)})
    a = torch.randint(-8, 9, (16, 32), generator=gen).to(torch.bfloat16)  # 16 rows x 16 k pairs
    b = torch.randint(-8, 9, (16, 32), generator=gen).to(torch.bfloat16)  # k pair r: (k0, k1) per column
    c0 = torch.randint(-100, 100, (16, 16), generator=gen).float()
    load(emu, 0, c0)
    load(emu, 4, a)
    load(emu, 6, b)
    emu.pk_emu_dpbf16ps(0, 4, 6)
    w = b.double().view(16, 16, 2).permute(0, 2, 1).reshape(32, 16)  # row 2r + h: k = 2r + h
    assert torch.equal(store(emu, 0, c0).double(), c0.double() + a.double() @ w)
    emu.pk_emu_release()


@pytest.mark.parametrize("a_signed,b_signed", [(1, 1), (1, 0), (0, 1), (0, 0)])
def test_int8_products_take_four_bytes_per_int32_with_their_signs(emu, a_signed, b_signed):
    gen = torch.Generator().manual_seed(a_signed * 2 + b_signed)
    configure(emu, {t: (16, 64) for t in range(TILES)})
    a = torch.randint(0, 256, (16, 64), generator=gen, dtype=torch.int32).to(torch.uint8)
    b = torch.randint(0, 256, (16, 64), generator=gen, dtype=torch.int32).to(torch.uint8)
    c0 = torch.randint(-(1 << 20), 1 << 20, (16, 16), generator=gen, dtype=torch.int32)
    load(emu, 1, c0)
    load(emu, 2, a)
    load(emu, 3, b)
    emu.pk_emu_dpb(1, 2, 3, a_signed, b_signed)
    av = a.view(torch.int8).long() if a_signed else a.long()
    bv = b.view(torch.int8).long() if b_signed else b.long()
    w = bv.view(16, 16, 4).permute(0, 2, 1).reshape(64, 16)  # row 4r + i: k = 4r + i
    assert torch.equal(store(emu, 1, c0).long(), c0.long() + av @ w)
    emu.pk_emu_release()


def test_a_smaller_configuration_moves_only_its_rows_and_bytes(emu):
    configure(emu, {0: (5, 24), 4: (5, 8), 6: (2, 24)})  # C 5 x 6 fp32, A 5 x 2 pairs, B 2 pairs x 6
    big = torch.arange(16 * 16, dtype=torch.float32).view(16, 16) + 1
    load(emu, 0, big)
    stored = store(emu, 0, torch.full((16, 16), -1.0))
    assert torch.equal(stored[:5, :6], big[:5, :6]) and (stored[5:] == 0).all() and (stored[:, 6:] == 0).all()
    a = torch.ones(16, 32, dtype=torch.bfloat16)
    b = torch.ones(16, 32, dtype=torch.bfloat16)
    load(emu, 4, a)
    load(emu, 6, b)
    emu.pk_emu_zero(0)
    emu.pk_emu_dpbf16ps(0, 4, 6)
    out = store(emu, 0, torch.zeros(16, 16))
    assert (out[:5, :6] == 4).all() and out.sum() == 4 * 5 * 6  # K = 2 pairs, 4 products
    emu.pk_emu_release()


ABORTS = """
import ctypes, sys
lib = ctypes.CDLL(sys.argv[1])
lib.pk_emu_zero.argtypes = (ctypes.c_int,)
lib.pk_emu_zero(0)
"""


def test_a_tile_used_before_its_configuration_aborts_with_a_message(emu):
    library = emulated_amx_library(cpu_build.compiler_command())
    run = subprocess.run(
        [sys.executable, "-c", ABORTS, str(library)], capture_output=True, text=True, timeout=60
    )
    assert run.returncode != 0 and "without a loaded configuration" in run.stderr
