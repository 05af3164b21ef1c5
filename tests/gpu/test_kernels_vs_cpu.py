"""Each CUDA kernel against the CPU oracle (worker.backends.cpu) on fresh random inputs:
outputs poisoned with NaN first (every element must be written), odd sizes, block
boundaries, GQA ratios, split-K partitions, and the CUDA-graph style launch where
max_seq_len is the buffer capacity rather than the step's length.

Split-K workspaces are NaN-poisoned too (`poison_workspace=True`): with rows of unequal
length some partitions are never written, and a reduce that read one would put NaN in the
output. Mixed steps (decode rows first, then prompts, `num_decode_seqs`) run both kernels
in one call, each over its own sequences.

Test ids name the dtype fp32 / fp16 / bf16, so `-k` can pick a subset (.ci/gpu-device runs
one under compute-sanitizer)."""

from __future__ import annotations

import os

import pytest
import torch

from kernels.cubin_cache import CubinCache
from kernels.launch import plan_decode
from kernels.specs import AttentionGeometry
from worker.backends.cpu import CpuAttentionBackend

CPU = CpuAttentionBackend()
TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
DTYPE_IDS = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
ALL_DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def dtype_id(dtype: torch.dtype) -> str:
    return DTYPE_IDS[dtype]


SHARED_CUBIN_CACHE_ENV = "PAGEDKV_TEST_CUBIN_CACHE"


def cubin_cache() -> CubinCache | None:
    """One cubin cache for several pytest sessions when SHARED_CUBIN_CACHE_ENV names it
    (.ci/gpu-device: the compute-sanitizer runs reuse the first run's cubins instead of
    compiling again); otherwise the session's own (tests/conftest.py)."""
    directory = os.environ.get(SHARED_CUBIN_CACHE_ENV)
    return CubinCache(directory) if directory else None


@pytest.fixture(scope="module")
def backend():
    from worker.backends.cuda import CudaAttentionBackend

    return CudaAttentionBackend("cuda", cache=cubin_cache())


@pytest.fixture(scope="module")
def poisoned_backend():
    """Split-K partials start as NaN on every launch: an unwritten partition that the reduce
    reads shows up in the output."""
    from worker.backends.cuda import CudaAttentionBackend

    return CudaAttentionBackend("cuda", cache=cubin_cache(), poison_workspace=True)


def paged_batch(seqs, block_size, num_kv_heads, head_dim, dtype, num_heads, seed):
    """Random pools and a varlen batch. seqs: [(context_len, query_len)]; tables use shuffled
    block ids so neighbouring logical blocks are never neighbours in memory."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-ctx // block_size) for ctx, _ in seqs]
    num_blocks = 1 + sum(blocks_per_seq) + 3
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    ids = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    width = max(blocks_per_seq) + 2
    tables = torch.zeros(len(seqs), width, dtype=torch.int32)
    for s, n in enumerate(blocks_per_seq):
        tables[s, :n] = torch.tensor([ids.pop() for _ in range(n)], dtype=torch.int32)
    q_lens = [q for _, q in seqs]
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    query = torch.randn(sum(q_lens), num_heads, head_dim, generator=gen).to(dtype)
    seq_lens = torch.tensor([ctx for ctx, _ in seqs], dtype=torch.int32)
    return query, k_cache, v_cache, tables, seq_lens, qsl


def check_attention(
    backend,
    seqs,
    block_size,
    heads,
    kv_heads,
    head_dim,
    dtype,
    seed,
    capacity=None,
    num_decode_seqs=0,
    host_seq_lens=None,
):
    """The backend's output (into a NaN-poisoned buffer) against the CPU oracle's; the
    launch hints (num_decode_seqs, host_seq_lens) go to both (the oracle ignores them)."""
    query, k, v, tables, lens, qsl = paged_batch(seqs, block_size, kv_heads, head_dim, dtype, heads, seed)
    scale = head_dim**-0.5
    max_q, max_ctx = max(q for _, q in seqs), max(c for c, _ in seqs)
    hints = dict(num_decode_seqs=num_decode_seqs, host_seq_lens=host_seq_lens)
    expected = CPU.paged_attention(query, k, v, tables, lens, qsl, scale, max_q, max_ctx, **hints).float()
    cuda = [t.cuda() for t in (query, k, v, tables, lens, qsl)]
    out = torch.full(query.shape, float("nan"), dtype=dtype, device="cuda")
    backend.paged_attention_into(out, *cuda, scale, max_q, capacity or max_ctx, **hints)
    actual = out.float().cpu()
    assert not actual.isnan().any(), "some output elements were never written"
    error = (actual - expected).abs().max().item()
    assert error <= TOLERANCE[dtype] * max(1.0, expected.abs().max().item()), f"max error {error:.3g}"


DECODE_CASES = [  # (contexts, block_size, heads, kv_heads, head_dim)
    ([1, 2, 15, 16, 17, 33, 100], 16, 8, 2, 64),
    ([5, 64, 257], 8, 32, 8, 128),
    ([700, 3], 32, 14, 2, 64),  # GQA 7: a tile of 8 with one idle head
    ([1, 31], 4, 4, 1, 16),
    ([129, 4], 4, 4, 2, 32),
    ([300], 16, 8, 8, 256),
    ([2049, 1, 513], 16, 32, 4, 128),  # long enough to split at small batch
    ([5000], 16, 16, 1, 64),  # MQA with a group of 16: two head chunks of 8
]


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("case", DECODE_CASES, ids=lambda c: f"ctx{c[0]}-bs{c[1]}-h{c[2]}-kv{c[3]}-d{c[4]}")
def test_decode_matches_oracle(backend, dtype, case):
    contexts, block_size, heads, kv_heads, head_dim = case
    seqs = [(ctx, 1) for ctx in contexts]
    check_attention(backend, seqs, block_size, heads, kv_heads, head_dim, dtype, seed=len(contexts))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=dtype_id)
def test_decode_planned_for_capacity_matches_oracle(backend, dtype):
    """The CUDA-graph launch: grid and partitions sized for 8192 keys, real contexts short,
    plus padding rows with seq_len 0 handled as in a padded bucket."""
    seqs = [(37, 1), (1, 1), (600, 1), (0, 1), (0, 1)]
    check_attention(backend, seqs, 16, 8, 2, 64, dtype, seed=3, capacity=8192)


PREFILL_CASES = [  # ([(context, query)], block_size, heads, kv_heads, head_dim)
    ([(1, 1), (63, 63), (64, 64), (65, 65)], 16, 8, 2, 64),
    ([(130, 130), (200, 7)], 8, 8, 4, 128),  # a chunk attending to a cached prefix
    ([(300, 1), (77, 77), (90, 45)], 16, 16, 8, 256),  # decode rows mixed with prefill
    ([(33, 20), (5, 5)], 4, 4, 1, 16),
    ([(100, 99), (64, 1)], 4, 4, 2, 32),
    ([(517, 517)], 32, 14, 2, 64),
]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=dtype_id)
@pytest.mark.parametrize(
    "case", PREFILL_CASES, ids=lambda c: f"{len(c[0])}seqs-bs{c[1]}-h{c[2]}-kv{c[3]}-d{c[4]}"
)
def test_prefill_matches_oracle(backend, dtype, case):
    seqs, block_size, heads, kv_heads, head_dim = case
    check_attention(backend, seqs, block_size, heads, kv_heads, head_dim, dtype, seed=len(seqs) + head_dim)


POISON_CASES = [  # (contexts, block_size, heads, kv_heads, head_dim, capacity, pass host lengths)
    # Graph-style launch: planned for 8192 keys, so short rows leave most partitions unwritten.
    ([5000, 37, 1, 2049, 700, 0], 16, 32, 8, 128, 8192, False),
    # Eager-style launch: the skewed batch's long row splits, the short ones end early.
    ([16384, 37, 1, 700], 16, 32, 4, 128, None, True),
    # MQA with a group of 16 (two head chunks per kv head), block 32.
    ([3000, 65, 1000], 32, 16, 1, 64, 4096, False),
]


def split_plan(backend, contexts, block_size, heads, kv_heads, head_dim, dtype, capacity, host_lens):
    """The decode plan the backend makes for this batch (CudaAttentionBackend._decode's inputs;
    the device's opt-in shared memory stands in for the kernel's limit, which only bounds a
    one-pass launch's block ids: a few KB here)."""
    geometry = AttentionGeometry(str(dtype).removeprefix("torch."), head_dim, block_size, heads, kv_heads)
    return plan_decode(
        len(contexts),
        capacity or max(contexts),
        block_size,
        kv_heads * geometry.head_chunks,
        backend.driver.num_sms,
        backend.driver.max_smem_optin,
        row_contexts=contexts if host_lens else None,
    )


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("case", POISON_CASES, ids=lambda c: f"ctx{max(c[0])}-rows{len(c[0])}-kv{c[3]}")
def test_decode_split_k_poisoned_workspace_matches_oracle(poisoned_backend, dtype, case):
    """Split-K with NaN-filled partials: rows shorter than the planned span leave their later
    partitions unwritten; the reduce must skip exactly those (no NaN, oracle's values)."""
    contexts, block_size, heads, kv_heads, head_dim, capacity, host_lens = case
    plan = split_plan(
        poisoned_backend, contexts, block_size, heads, kv_heads, head_dim, dtype, capacity, host_lens
    )
    if not plan.split:
        pytest.skip(f"{poisoned_backend.driver.num_sms} SMs: the planner runs this batch in one pass")
    span = (plan.num_partitions - 1) * plan.partition_tokens
    assert min(contexts) < span, "every partition written: the case would not test the poison"
    seqs = [(ctx, 1) for ctx in contexts]
    host_seq_lens = contexts if host_lens else None
    check_attention(
        poisoned_backend,
        seqs,
        block_size,
        heads,
        kv_heads,
        head_dim,
        dtype,
        seed=len(contexts) + 7,
        capacity=capacity,
        num_decode_seqs=len(seqs),
        host_seq_lens=host_seq_lens,
    )


MIXED_CASES = [  # ([(context, query)], decode seqs first, block_size, heads, kv_heads, head_dim, host lens)
    ([(300, 1), (17, 1), (1, 1), (77, 77), (90, 45)], 3, 16, 8, 2, 64, False),
    # Long decode rows (split-K, poisoned workspace) beside a prompt and a cached-prefix chunk.
    ([(5000, 1), (2049, 1), (130, 130), (200, 7)], 2, 16, 32, 4, 128, True),
    # Fewer decodes declared than leading one-row sequences: the second goes to the prefill kernel.
    ([(40, 1), (64, 1), (100, 99)], 1, 8, 16, 8, 128, False),
    # GQA 7 (a decode tile of 8 with one idle head), block 32, one long prompt.
    ([(33, 1), (517, 517)], 1, 32, 14, 2, 64, False),
]


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=dtype_id)
@pytest.mark.parametrize(
    "case", MIXED_CASES, ids=lambda c: f"{c[1]}dec-{len(c[0]) - c[1]}pre-bs{c[2]}-h{c[3]}-kv{c[4]}-d{c[5]}"
)
def test_mixed_decode_prefill_matches_oracle(poisoned_backend, dtype, case):
    """One call, decode rows first then prompts, num_decode_seqs = D: fp16/bf16 send the D
    decode rows through the decode kernel and the rest through the prefill kernel (fp32: the
    decode kernel takes all); output NaN-poisoned, every row must match the oracle."""
    seqs, decodes, block_size, heads, kv_heads, head_dim, host_lens = case
    assert all(q == 1 for _, q in seqs[:decodes]) and max(q for _, q in seqs) > 1
    host_seq_lens = [ctx for ctx, _ in seqs] if host_lens else None
    check_attention(
        poisoned_backend,
        seqs,
        block_size,
        heads,
        kv_heads,
        head_dim,
        dtype,
        seed=decodes + head_dim,
        num_decode_seqs=decodes,
        host_seq_lens=host_seq_lens,
    )


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=dtype_id)
def test_write_kv_matches_oracle_and_skips_padding(backend, dtype):
    gen = torch.Generator().manual_seed(1)
    shape = (9, 16, 2, 64)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    slots = torch.tensor([16, 17, 31, -1, 140, 15, -1, 47], dtype=torch.int64)
    key = torch.randn(8, 2, 64, generator=gen).to(dtype)
    value = torch.randn(8, 2, 64, generator=gen).to(dtype)
    k_gpu, v_gpu = k_cache.cuda(), v_cache.cuda()
    backend.write_kv(k_gpu, v_gpu, key.cuda(), value.cuda(), slots.cuda())
    CPU.write_kv(k_cache, v_cache, key, value, slots)
    torch.testing.assert_close(k_gpu.cpu(), k_cache, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(v_gpu.cpu(), v_cache, rtol=0, atol=0, equal_nan=True)


def test_copy_blocks_matches_oracle_in_every_layer(backend):
    gen = torch.Generator().manual_seed(2)
    k_caches = [torch.randn(12, 8, 2, 32, generator=gen).half() for _ in range(3)]
    v_caches = [torch.randn(12, 8, 2, 32, generator=gen).half() for _ in range(3)]
    pairs = torch.tensor([[3, 7], [3, 8], [5, 11]], dtype=torch.int64)
    k_gpu, v_gpu = [c.cuda() for c in k_caches], [c.cuda() for c in v_caches]
    backend.copy_blocks(k_gpu, v_gpu, pairs.cuda())
    CPU.copy_blocks(k_caches, v_caches, pairs)
    for gpu, cpu in zip([*k_gpu, *v_gpu], [*k_caches, *v_caches], strict=True):
        assert torch.equal(gpu.cpu(), cpu)
