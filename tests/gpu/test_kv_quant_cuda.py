"""The CUDA quantized KV cache (issue 31) against the CPU oracle (worker/kv_quant.py, which the
CPU kernels equal bit for bit): the write kernel's codes and scale bytes, attention over
quantized pools (decode, split-K, tensor-core prefill), and whole workers' tokens and logits.
Skipped, with the reason printed, where torch sees no CUDA device (tests/gpu/conftest.py).

What a GPU session must run: `pytest -m gpu tests/gpu/test_kv_quant_cuda.py -ra`
(docs/GPU_VALIDATION.md)."""

from __future__ import annotations

import pytest
import torch

from tests.gpu.test_engine_cuda import MODELS, mixed_scenario
from tests.gpu.test_kernels_vs_cpu import cubin_cache, paged_batch
from tests.worker.worker_test_utils import PlanDriver, assert_logits_close, make_worker
from worker.backends.cpu import CpuAttentionBackend
from worker.kv_quant import FORMATS, KvQuantPools, dequantize, quantize

CPU = CpuAttentionBackend()
FORMAT_NAMES = list(FORMATS)


@pytest.fixture(scope="module")
def backend():
    from worker.backends.cuda import CudaAttentionBackend

    return CudaAttentionBackend("cuda", cache=cubin_cache(), poison_workspace=True)


def wide_rows(tokens: int, kv_heads: int, head_dim: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    magnitude = torch.pow(10.0, torch.empty(tokens, kv_heads, 1).uniform_(-6, 4, generator=gen))
    rows = torch.randn(tokens, kv_heads, head_dim, generator=gen) * magnitude
    rows[::5, 0] = 0.0
    return rows


@pytest.mark.parametrize("tensor_scale", [0.0, 0.05])
@pytest.mark.parametrize("head_dim", [16, 64, 128, 256])
@pytest.mark.parametrize("name", FORMAT_NAMES)
def test_write_kernel_stores_the_oracles_codes_and_bytes(backend, name, head_dim, tensor_scale):
    """From fp32 K/V (what the oracle quantizes), codes and bytes are equal to the oracle's;
    padding slots (-1) write nothing."""
    fmt, kv_heads, tokens, num_blocks, block_size = FORMATS[name], 2, 37, 12, 4
    key, value = (wide_rows(tokens, kv_heads, head_dim, seed) for seed in (1, 2))
    if tensor_scale:
        key, value = key.clamp(-20, 20), value.clamp(-20, 20)
    slots = torch.randperm(num_blocks * block_size)[:tokens]
    slots[4] = -1
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_codes, v_codes = (torch.zeros(shape, dtype=torch.uint8, device="cuda") for _ in range(2))
    k_bytes, v_bytes = (torch.zeros(shape[:-1], dtype=torch.uint8, device="cuda") for _ in range(2))
    quant = KvQuantPools(name, k_bytes, v_bytes, tensor_scale, tensor_scale)
    backend.write_kv_quantized(k_codes, v_codes, key.cuda(), value.cuda(), slots.cuda(), quant)
    keep = slots >= 0
    for pool, scales, x in ((k_codes, k_bytes, key), (v_codes, v_bytes, value)):
        codes, byte = quantize(x[keep], fmt, tensor_scale)
        assert torch.equal(pool.view(-1, kv_heads, head_dim)[slots[keep]].cpu(), codes)
        assert torch.equal(scales.view(-1, kv_heads)[slots[keep]].cpu(), byte)
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool)
    untouched[slots[keep]] = False
    assert (k_codes.view(-1, kv_heads, head_dim)[untouched.cuda()] == 0).all()


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"]
)
@pytest.mark.parametrize("name", FORMAT_NAMES)
def test_attention_over_quantized_pools_matches_the_oracle(backend, name, dtype):
    """Decode rows (one pass and split-K at 1k+ keys) and prefill chunks over codes in shuffled
    blocks, against the CPU reference over the oracle's dequantized pools."""
    fmt, heads, kv_heads, head_dim, block_size = FORMATS[name], 14, 2, 64, 16
    seqs = [(1300, 1), (77, 1), (5, 1), (200, 70), (64, 64)]
    query, k, v, tables, lens, qsl = paged_batch(
        seqs, block_size, kv_heads, head_dim, torch.float32, heads, 3
    )
    (k_codes, k_bytes), (v_codes, v_bytes) = (quantize(pool, fmt) for pool in (k, v))
    scale = head_dim**-0.5
    want = CPU.paged_attention(
        query, dequantize(k_codes, k_bytes, fmt), dequantize(v_codes, v_bytes, fmt), tables, lens, qsl,
        scale, 70, 1300,
    )  # fmt: skip
    quant = KvQuantPools(name, k_bytes.cuda(), v_bytes.cuda())
    got = backend.paged_attention(
        query.to(dtype).cuda(), k_codes.cuda(), v_codes.cuda(), tables.cuda(), lens.cuda(), qsl.cuda(), scale,
        70, 1300, num_decode_seqs=3, host_seq_lens=lens.tolist(), kv_quant=quant,
    )  # fmt: skip
    tolerance = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}[dtype]
    torch.testing.assert_close(got.float().cpu(), want, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "int8"])
def test_fp32_worker_with_a_quantized_cache_equals_the_cpu_worker(checkpoint, name, kv_cache_dtype):
    """fp32 models: the CUDA worker's quantized cache against the CPU fast forward's over the
    same plans (prompts, chunks, decodes, copy-on-write-free mixed steps): greedy tokens equal
    and logits close (K/V may differ by a code where the two RoPEs round differently)."""
    _, path = checkpoint(name)
    cpu = PlanDriver(make_worker(path, 4, cpu_kernels="fast", kv_cache_dtype=kv_cache_dtype))
    gpu = PlanDriver(make_worker(path, 4, device="cuda", kv_cache_dtype=kv_cache_dtype))
    mixed_scenario(cpu)
    mixed_scenario(gpu)
    for seq_id, seq in cpu.seqs.items():
        assert gpu.seqs[seq_id].generated == seq.generated
        for actual, expected in zip(gpu.seqs[seq_id].logits, seq.logits, strict=True):
            assert_logits_close(actual.cpu(), expected, rel=0.02)


def test_block_copies_carry_codes_and_scale_bytes_on_gpu(checkpoint):
    _, path = checkpoint("qwen2-mqa-bias")
    worker = make_worker(path, 4, device="cuda", kv_cache_dtype="int8")
    driver = PlanDriver(worker)
    driver.add(1, list(range(5, 13)))
    driver.step({1: None})
    cache = worker.kv_cache
    cache.copy_blocks([(1, 7), (2, 9)])
    for layer in range(len(cache.k_caches)):
        for pools in (cache.k_caches, cache.v_caches, cache.k_exps, cache.v_exps):
            assert torch.equal(pools[layer][7], pools[layer][1]) and torch.equal(
                pools[layer][9], pools[layer][2]
            )
