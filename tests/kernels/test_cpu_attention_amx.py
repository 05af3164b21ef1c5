"""Prefill attention on AMX tiles (kernels/cpu_attention_amx.c, in the avx512amx variant): bf16
pools, sequences with a full 16-row tile of query rows. Against the reference on the widened
pool at the fp32 kernel's tolerance (q and p enter the tiles as three bf16 parts each, so the
tiles keep fp32's precision); bit-identical across block sizes and across chunkings of one
prompt (key steps follow absolute positions); sliding windows never read keys before the
window; decode rows of narrow GQA groups, and contexts past the tiles' key limit, run the
AVX-512 kernel. Runs only where this CPU and kernel run AMX; elsewhere each test skips saying why."""

from __future__ import annotations

import random

import pytest
import torch

from tests.kernels.test_cpu_ops import back_to_front_pools, random_paged_batch, run_attention
from worker.backends.cpu import CpuAttentionBackend

BF16 = torch.bfloat16
MAX_KEYS = 8192  # kernels/cpu_attention.h AMX_ATTN_MAX_KEYS
DECODE_MIN_GROUP = 4  # kernels/cpu_attention.h AMX_DECODE_MIN_GROUP


@pytest.fixture
def amx(all_ops):
    if "avx512amx" not in all_ops:
        pytest.skip(f"this CPU or kernel does not run AMX tiles (variants here: {', '.join(all_ops)})")
    return all_ops["avx512amx"]


def _reference(batch, scale, window=0):
    query, k_cache, v_cache, tables, seq_lens, qsl = batch
    q_lens = (qsl[1:] - qsl[:-1]).tolist()
    pools = (k_cache.float(), v_cache.float())
    longest = int(seq_lens.max())
    return CpuAttentionBackend().paged_attention(
        query, *pools, tables, seq_lens, qsl, scale, max(q_lens), longest, window=window
    )


@pytest.mark.parametrize(
    "heads,kv_heads,dim",
    [(14, 2, 64), (8, 8, 128), (4, 1, 32), (6, 2, 96), (2, 1, 256)],  # GQA 7, MHA, MQA, dim % 64 = 32
)
@pytest.mark.parametrize("block_size", [16, 5])
def test_tiles_match_the_reference_and_decode_rows_keep_their_kernel(all_ops, amx, heads, kv_heads, dim,
                                                                      block_size):  # fmt: skip
    """A whole prompt (odd length: a partial last tile), a chunk starting mid-sequence, a decode
    row and a chunk too short for a tile, all in one step."""
    rng = random.Random(heads * 100 + dim + block_size)
    q_lens, ctx_lens = [37, 23, 1, 3], [37, 90, 61, 3]
    batch = random_paged_batch(rng, q_lens, ctx_lens, heads, kv_heads, dim, block_size, BF16)
    scale = dim**-0.5
    got = run_attention(amx, *batch, scale)
    torch.testing.assert_close(got, _reference(batch, scale), rtol=1e-5, atol=2e-6)
    if "avx512bf16" in all_ops:  # same CPU without tiles
        plain = run_attention(all_ops["avx512bf16"], *batch, scale)
        decode = slice(37 + 23, 37 + 23 + 1)
        if heads // kv_heads >= DECODE_MIN_GROUP:  # the decode tiles (test_cpu_attention_decode_amx.py)
            assert not torch.equal(got[decode], plain[decode]), "the decode row did not go through the tiles"
        else:  # too few heads per kv head for the decode tiles: the AVX-512 kernel's bits
            assert torch.equal(got[decode], plain[decode])
        assert not torch.equal(got[:37], plain[:37]), "the prefill rows did not go through the tiles"


def test_bit_identical_across_block_sizes_and_chunkings(amx):
    """One 100-token context in blocks of 1, 16 and one 128-token row; and its last 100 queries
    as one chunk or as chunks of 60 and 40 (the second reading the first's keys): same bits."""
    heads, kv_heads, dim, ctx = 8, 2, 64, 100
    keys, values = torch.randn(ctx, kv_heads, dim).to(BF16), torch.randn(ctx, kv_heads, dim).to(BF16)
    query = torch.randn(ctx, heads, dim)
    outputs = []

    def chunk(pools, first, last):  # queries [first, last) of the context, as one chunk
        lens = (torch.tensor([last], dtype=torch.int32), torch.tensor([0, last - first], dtype=torch.int32))
        return run_attention(amx, query[first:last].contiguous(), *pools, *lens, 0.125)

    for block_size in (1, 16, 128):
        pools = back_to_front_pools(keys, values, block_size)
        outputs.append(chunk(pools, 0, ctx))
        if block_size == 16:
            assert torch.equal(torch.cat([chunk(pools, 0, 60), chunk(pools, 60, ctx)]), outputs[-1])
    assert torch.equal(outputs[0], outputs[1]) and torch.equal(outputs[0], outputs[2])


@pytest.mark.parametrize("window", [1, 17, 64])
def test_sliding_windows_read_no_key_before_the_window(amx, window):
    rng = random.Random(window)
    heads, kv_heads, dim, block_size = 8, 2, 64, 4
    q_lens, ctx_lens = [50, 31, 1], [50, 140, 77]
    batch = random_paged_batch(rng, q_lens, ctx_lens, heads, kv_heads, dim, block_size, BF16)
    query, k_cache, v_cache, tables, seq_lens, qsl = batch
    want = _reference(batch, 0.125, window)
    for s, (q_len, ctx) in enumerate(zip(q_lens, ctx_lens, strict=True)):
        first_visible = max(0, ctx - q_len - window + 1)
        for b in range(first_visible // block_size):  # blocks wholly before every window: NaN
            k_cache[tables[s, b]] = float("nan")
            v_cache[tables[s, b]] = float("nan")
    got = run_attention(amx, query, k_cache, v_cache, tables, seq_lens, qsl, 0.125, window)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-6)


def test_a_context_past_the_key_limit_takes_the_avx512_kernel(all_ops, amx):
    """Past AMX_ATTN_MAX_KEYS the scores row would outgrow the tile kernel's buffers: the chunk
    runs the AVX-512 kernel, bit-identical to the variant without tiles."""
    rng = random.Random(7)
    batch = random_paged_batch(rng, [16, 16], [MAX_KEYS + 40, MAX_KEYS], 1, 1, 32, 64, BF16)
    got = run_attention(amx, *batch, 0.2)
    torch.testing.assert_close(got, _reference(batch, 0.2), rtol=1e-5, atol=2e-6)
    if "avx512bf16" in all_ops:
        plain = run_attention(all_ops["avx512bf16"], *batch, 0.2)
        assert torch.equal(got[:16], plain[:16])  # past the limit: the same kernel
        assert not torch.equal(got[16:], plain[16:])  # at the limit: the tiles
