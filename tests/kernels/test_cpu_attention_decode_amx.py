"""Decode rows on AMX tiles (kernels/cpu_attention_decode_amx.c, in the avx512amx variant): bf16
pools, GQA groups of 4 to 15 query heads per kv head (16 or more fill a prefill tile by
themselves and take cpu_attention_amx.c). Against the reference on the widened pool
at the fp32 kernel's tolerance (q enters the tiles as three bf16 parts); the rows did go through
the tiles (not the AVX-512 kernel's bits); bit-identical across block sizes (keys in chunks of
16 positions from the first visible one); sliding windows never read a key before the window;
narrow groups and fp16 pools keep the AVX-512 kernel. Runs only where this CPU and
kernel run AMX; elsewhere each test skips saying why."""

from __future__ import annotations

import random

import pytest
import torch

from tests.kernels.test_cpu_attention_amx import _reference
from tests.kernels.test_cpu_ops import back_to_front_pools, random_paged_batch, run_attention

BF16 = torch.bfloat16
# every context length class: one key, a partial chunk, one chunk, a chunk and one, many chunks
CTX_LENS = [1, 15, 16, 17, 70, 301]


@pytest.fixture
def amx(all_ops):
    if "avx512amx" not in all_ops:
        pytest.skip(f"this CPU or kernel does not run AMX tiles (variants here: {', '.join(all_ops)})")
    return all_ops["avx512amx"]


@pytest.mark.parametrize(
    "heads,kv_heads,dim",
    # groups 7, 4, 15, 4, 15, 4
    [(14, 2, 64), (16, 4, 128), (30, 2, 64), (12, 3, 96), (15, 1, 256), (8, 2, 32)],
)
@pytest.mark.parametrize("block_size", [16, 5])
def test_decode_rows_on_tiles_match_the_reference(all_ops, amx, heads, kv_heads, dim, block_size):
    rng = random.Random(heads * 1000 + dim + block_size)
    batch = random_paged_batch(rng, [1] * len(CTX_LENS), CTX_LENS, heads, kv_heads, dim, block_size, BF16)
    scale = dim**-0.5
    got = run_attention(amx, *batch, scale)
    torch.testing.assert_close(got, _reference(batch, scale), rtol=1e-5, atol=2e-6)
    if "avx512bf16" in all_ops:  # same CPU without tiles: another summation order, so other bits
        plain = run_attention(all_ops["avx512bf16"], *batch, scale)
        for row, ctx in enumerate(CTX_LENS):  # (one key: both return its V row exactly)
            tiles = ctx == 1 or not torch.equal(got[row], plain[row])
            assert tiles, f"row {row} did not go through the tiles"


def test_bit_identical_across_block_sizes(amx):
    heads, kv_heads, dim, ctx = 14, 2, 64, 100
    keys, values = torch.randn(ctx, kv_heads, dim).to(BF16), torch.randn(ctx, kv_heads, dim).to(BF16)
    query = torch.randn(1, heads, dim)
    lens = (torch.tensor([ctx], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32))
    outputs = [
        run_attention(amx, query, *back_to_front_pools(keys, values, block_size), *lens, 0.125)
        for block_size in (1, 16, 128)
    ]
    assert torch.equal(outputs[0], outputs[1]) and torch.equal(outputs[0], outputs[2])


@pytest.mark.parametrize("window", [1, 17, 64])
def test_sliding_windows_read_no_key_before_the_window(amx, window):
    rng = random.Random(window)
    heads, kv_heads, dim, block_size = 8, 2, 64, 4
    ctx_lens = [50, 140, 77, 3]
    batch = random_paged_batch(rng, [1] * len(ctx_lens), ctx_lens, heads, kv_heads, dim, block_size, BF16)
    query, k_cache, v_cache, tables, seq_lens, qsl = batch
    want = _reference(batch, 0.125, window)
    for s, ctx in enumerate(ctx_lens):
        for b in range(max(0, ctx - window) // block_size):  # blocks wholly before the window: NaN
            k_cache[tables[s, b]] = float("nan")
            v_cache[tables[s, b]] = float("nan")
    got = run_attention(amx, query, k_cache, v_cache, tables, seq_lens, qsl, 0.125, window)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize(
    "heads,kv_heads,kv_dtype",
    [(6, 2, BF16), (8, 8, BF16), (14, 2, torch.float16)],  # groups 3 and 1; an fp16 pool
)
def test_other_decode_rows_keep_the_avx512_kernel(all_ops, amx, heads, kv_heads, kv_dtype):
    if "avx512bf16" not in all_ops:
        pytest.skip("no avx512bf16 variant here to compare bits with")
    rng = random.Random(heads)
    batch = random_paged_batch(rng, [1] * len(CTX_LENS), CTX_LENS, heads, kv_heads, 64, 16, kv_dtype)
    assert torch.equal(run_attention(amx, *batch, 0.125), run_attention(all_ops["avx512bf16"], *batch, 0.125))
