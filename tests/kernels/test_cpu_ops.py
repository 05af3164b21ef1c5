"""The fast CPU worker's C kernels (kernels/cpu_ops.c, cpu_attention.c) against the torch
reference ops they replace: attention over random paged layouts (GQA, block sizes, prefill
chunks, decode rows) with fp32, bf16 and fp16 pools, the fused q/k-norm + RoPE + KV store (K/V
rounded exactly as torch rounds), the norms and SiLU-mul; in every ISA variant this CPU runs
(the linear layers' kernel: tests/kernels/test_cpu_gemm.py; the build: test_cpu_build.py)."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from worker.backends.cpu import CpuAttentionBackend
from worker.cpu_weights import dtype_code
from worker.rotary import apply_rotary

THREADS = 2
KV_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def random_paged_batch(rng, q_lens, ctx_lens, heads, kv_heads, dim, block_size, kv_dtype=torch.float32):
    """Pools holding every sequence's context in shuffled blocks, and the step's queries."""
    tables = []
    blocks = list(range(1, 1 + sum(-(-n // block_size) for n in ctx_lens)))
    rng.shuffle(blocks)
    for n in ctx_lens:
        need = -(-n // block_size)
        tables.append([blocks.pop() for _ in range(need)])
    width = max(len(t) for t in tables)
    table_tensor = torch.zeros(len(tables), width, dtype=torch.int32)
    for row, table in enumerate(tables):
        table_tensor[row, : len(table)] = torch.tensor(table, dtype=torch.int32)
    num_blocks = 1 + sum(len(t) for t in tables)
    k_cache = torch.randn(num_blocks, block_size, kv_heads, dim).to(kv_dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, dim).to(kv_dtype)
    qsl = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(q_lens), 0)
    query = torch.randn(int(qsl[-1]), heads, dim)
    return query, k_cache, v_cache, table_tensor, torch.tensor(ctx_lens, dtype=torch.int32), qsl


def back_to_front_pools(keys, values, block_size):
    """Pools holding one sequence's keys/values [ctx, kv_heads, dim] in blocks stored back to
    front (block 0 unused), and its one-row block table."""
    ctx = keys.shape[0]
    num_blocks = -(-ctx // block_size)
    k_cache = torch.zeros(num_blocks + 1, block_size, *keys.shape[1:], dtype=keys.dtype)
    v_cache = torch.zeros_like(k_cache)
    order = list(range(1, num_blocks + 1))[::-1]
    for i, block in enumerate(order):
        part = slice(i * block_size, min(ctx, (i + 1) * block_size))
        n = part.stop - part.start
        k_cache[block, :n], v_cache[block, :n] = keys[part], values[part]
    return k_cache, v_cache, torch.tensor([order], dtype=torch.int32)


def run_attention(ops, query, k_cache, v_cache, tables, seq_lens, qsl, scale, window=0, threads=THREADS):
    out = torch.full_like(query, float("nan"))
    heads, dim = query.shape[1], query.shape[2]
    status = ops.paged_attention(
        out.data_ptr(), query.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), dtype_code(k_cache.dtype),
        None, None, 0.0, 0.0, tables.data_ptr(),
        tables.shape[1], seq_lens.data_ptr(), qsl.data_ptr(), len(seq_lens), heads, k_cache.shape[2],
        dim, k_cache.shape[1], scale, window, threads,
    )  # fmt: skip
    assert status == 0
    return out


@pytest.mark.parametrize(
    "heads,kv_heads,dim",
    [(8, 4, 64), (4, 1, 32), (4, 4, 128), (6, 2, 48), (2, 1, 16)],
)
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_paged_attention_matches_reference(ops, heads, kv_heads, dim, block_size, kv_dtype):
    """16-bit pools widen exactly to fp32 as they are read: the reference runs on the widened
    pool, so the tolerance is the fp32 one."""
    rng = random.Random(heads * 1000 + dim + block_size)
    # a whole prompt, a chunk starting mid-sequence, decode rows, a sequence with no query
    q_lens = [13, 5, 1, 1, 0, 1]
    ctx_lens = [13, 40, 77, 1, 9, 33]
    batch = random_paged_batch(rng, q_lens, ctx_lens, heads, kv_heads, dim, block_size, kv_dtype)
    query, k_cache, v_cache, tables, seq_lens, qsl = batch
    scale = dim**-0.5
    got = run_attention(ops, *batch, scale)
    want = CpuAttentionBackend().paged_attention(
        query, k_cache.float(), v_cache.float(), tables, seq_lens, qsl, scale, max(q_lens), max(ctx_lens)
    )
    torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize(
    "heads,kv_heads,dim", [(10, 2, 64), (14, 2, 64), (16, 2, 96), (24, 2, 128), (12, 1, 32)]
)
@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_decode_rows_of_wide_gqa_groups_match_reference(ops, heads, kv_heads, dim, kv_dtype):
    """Decode rows of groups of 5 to 12 query heads per kv head (the AVX-512 kernel scores a
    group's heads in registers, up to 8 at a time: 7, 8 and 12 take every path through that
    batching), contexts that end on, before and after a 16-key chunk, in 5-token blocks so the
    chunks straddle blocks."""
    rng = random.Random(heads * 100 + dim)
    ctx_lens = [1, 15, 16, 17, 100]
    batch = random_paged_batch(rng, [1] * len(ctx_lens), ctx_lens, heads, kv_heads, dim, 5, kv_dtype)
    query, k_cache, v_cache, tables, seq_lens, qsl = batch
    got = run_attention(ops, *batch, dim**-0.5)
    want = CpuAttentionBackend().paged_attention(
        query, k_cache.float(), v_cache.float(), tables, seq_lens, qsl, dim**-0.5, 1, max(ctx_lens)
    )
    torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize(
    "threads,window,ctx_lens", [(2, 0, [2000]), (8, 0, [2000, 300]), (8, 700, [2000, 300]), (3, 0, [1000])]
)
@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_long_decode_rows_split_across_threads_match_reference(ops, threads, window, ctx_lens, kv_dtype):
    """Fewer decode rows than threads: each long row's keys split into parts whose outputs merge
    by their log-sum-exp (2000 keys on 2 threads: 2 parts; 2 rows on 8 threads: 4 parts of 512,
    a 700-key window 2, and the 300-key row too short to split; 1000 keys on 3 threads: 3 parts of
    336), against the reference."""
    rng = random.Random(threads * 10 + window)
    q_lens = [1] * len(ctx_lens)
    batch = random_paged_batch(rng, q_lens, ctx_lens, 8, 2, 64, 16, kv_dtype)
    query, k_cache, v_cache, tables, seq_lens, qsl = batch
    got = run_attention(ops, *batch, 0.125, window, threads=threads)
    want = CpuAttentionBackend().paged_attention(
        query, k_cache.float(), v_cache.float(), tables, seq_lens, qsl, 0.125, 1, max(ctx_lens), window=window
    )
    torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-6)


def test_attention_is_bit_identical_across_block_sizes(ops):
    """The same logical context in blocks of 1, 8 and one 128-token row (the contiguous layout)
    gives the same bits: reduction order follows positions, never blocks."""
    heads, kv_heads, dim, ctx = 8, 2, 64, 100
    keys, values = torch.randn(ctx, kv_heads, dim), torch.randn(ctx, kv_heads, dim)
    query = torch.randn(3, heads, dim)  # the last 3 positions
    seq_lens, qsl = torch.tensor([ctx], dtype=torch.int32), torch.tensor([0, 3], dtype=torch.int32)
    outputs = []
    for block_size in (1, 8, 128):
        k_cache, v_cache, tables = back_to_front_pools(keys, values, block_size)
        outputs.append(run_attention(ops, query, k_cache, v_cache, tables, seq_lens, qsl, 0.125))
    assert torch.equal(outputs[0], outputs[1]) and torch.equal(outputs[0], outputs[2])


@pytest.mark.parametrize("qk_norm", [True, False])
@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_qkv_rope_store_matches_reference(ops, qk_norm, kv_dtype):
    tokens, heads, kv_heads, dim, eps = 7, 4, 2, 32, 1e-6
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim)
    positions = torch.tensor([0, 1, 2, 50, 51, 300, 7])
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    freqs = positions[:, None].float() * inv_freq[None, :]
    cos, sin = freqs.cos(), freqs.sin()
    slots = torch.tensor([3, 9, 0, -1, 5, 20, 11])  # -1: padding, stores nothing
    q_w, k_w = torch.rand(dim) + 0.5, torch.rand(dim) + 0.5
    k_cache = torch.zeros(24, kv_heads, dim, dtype=kv_dtype)
    v_cache = torch.zeros(24, kv_heads, dim, dtype=kv_dtype)
    q_out = torch.empty(tokens, heads * dim)
    norms = (q_w.data_ptr(), k_w.data_ptr()) if qk_norm else (None, None)
    ops.qkv_rope_store(
        qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), slots.data_ptr(), *norms, q_out.data_ptr(),
        k_cache.data_ptr(), v_cache.data_ptr(), dtype_code(kv_dtype), tokens, heads, kv_heads, dim, eps,
        None, None, 0.0, 0.0, THREADS,
    )  # fmt: skip
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=1)
    q, k, v = q.view(tokens, heads, dim), k.view(tokens, kv_heads, dim), v.view(tokens, kv_heads, dim)
    if qk_norm:
        q, k = F.rms_norm(q, (dim,), q_w, eps), F.rms_norm(k, (dim,), k_w, eps)
    full_cos, full_sin = torch.cat((cos, cos), -1), torch.cat((sin, sin), -1)
    q, k = apply_rotary(q, full_cos, full_sin), apply_rotary(k, full_cos, full_sin)
    torch.testing.assert_close(q_out.view(tokens, heads, dim), q, rtol=1e-5, atol=1e-5)
    want_k, want_v = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    keep = slots >= 0
    want_k[slots[keep]], want_v[slots[keep]] = k[keep].to(kv_dtype), v[keep].to(kv_dtype)
    # K went through fp32 RoPE math in a different order: within one rounding step of the pool's dtype
    ulp = {torch.float32: 1e-5, torch.bfloat16: 8e-3, torch.float16: 1e-3}[kv_dtype]
    torch.testing.assert_close(k_cache.float(), want_k.float(), rtol=ulp, atol=ulp)
    assert torch.equal(v_cache, want_v)  # V is rounded to the pool's dtype exactly as torch rounds it


def test_norms_and_silu_mul_match_reference(ops):
    rows, dim, inner, eps = 9, 96, 40, 1e-5
    x, delta, w = torch.randn(rows, dim), torch.randn(rows, dim), torch.rand(dim) + 0.5
    out = torch.empty_like(x)
    ops.rms_norm(out.data_ptr(), x.data_ptr(), w.data_ptr(), rows, dim, eps, THREADS)
    torch.testing.assert_close(out, F.rms_norm(x, (dim,), w, eps), rtol=1e-5, atol=1e-6)
    residual = x.clone()
    ops.add_rms_norm(residual.data_ptr(), delta.data_ptr(), out.data_ptr(), w.data_ptr(), rows, dim, eps, 1)
    assert torch.equal(residual, x + delta)
    torch.testing.assert_close(out, F.rms_norm(x + delta, (dim,), w, eps), rtol=1e-5, atol=1e-6)
    gate_up = torch.randn(rows, 2 * inner) * 30  # large |gate|: exp's clamped range is exercised
    activated = torch.empty(rows, inner)
    ops.silu_mul(activated.data_ptr(), gate_up.data_ptr(), rows, inner, THREADS)
    gate, up = gate_up.chunk(2, dim=1)
    torch.testing.assert_close(activated, F.silu(gate) * up, rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("window", [1, 5, 16, 37])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_sliding_window_attention_matches_reference(ops, window, block_size):
    """A sliding-window layer (issue 31): decode rows and prefill tiles see only the `window`
    positions up to their own, as the reference (and Hugging Face) masks; keys before the
    window are never read, so their blocks may hold anything (here: NaN)."""
    rng = random.Random(window * 10 + block_size)
    heads, kv_heads, dim = 8, 2, 64
    q_lens, ctx_lens = [13, 21, 1, 1, 1], [13, 60, 77, 3, 40]
    batch = random_paged_batch(rng, q_lens, ctx_lens, heads, kv_heads, dim, block_size)
    query, k_cache, v_cache, tables, seq_lens, qsl = batch
    want = CpuAttentionBackend().paged_attention(
        query, k_cache, v_cache, tables, seq_lens, qsl, 0.125, max(q_lens), max(ctx_lens), window=window
    )
    for s, (q_len, ctx) in enumerate(zip(q_lens, ctx_lens, strict=True)):
        first_visible = max(0, ctx - q_len - window + 1)  # the earliest any of its queries sees
        for b in range(first_visible // block_size):  # blocks wholly before every window
            k_cache[tables[s, b]] = float("nan")
            v_cache[tables[s, b]] = float("nan")
    got = run_attention(ops, query, k_cache, v_cache, tables, seq_lens, qsl, 0.125, window)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-6)
