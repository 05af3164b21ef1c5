"""Quantized K/V pools in the fast CPU kernels (kernels/cpu_kv_quant.h) against the torch oracle
(worker/kv_quant.py), in every ISA variant this CPU runs: the store writes the oracle's codes
and scale bytes exactly (round to nearest even; the e5m3 scale byte), and attention over
fp8 / int8 pools equals the reference attention over the dequantized context."""

from __future__ import annotations

import random

import pytest
import torch

from tests.kernels.test_cpu_ops import random_paged_batch
from worker.backends.cpu import CpuAttentionBackend
from worker.kv_quant import FORMATS, SCALE_ONE, dequantize, quantize, scale_bytes, scale_of

THREADS = 2
FORMAT_NAMES = list(FORMATS)


def wide_range_values(shape, seed: int) -> torch.Tensor:
    """Values from 1e-8 to 1e7 in magnitude, both signs, some heads all zero: every code range,
    subnormal codes, the smallest and largest scale bytes and saturation included."""
    gen = torch.Generator().manual_seed(seed)
    magnitude = torch.pow(10.0, torch.empty(shape[:-1]).uniform_(-8, 7, generator=gen))[..., None]
    values = torch.randn(shape, generator=gen) * magnitude
    values.view(-1, shape[-1])[::7] = 0.0
    return values


def store(ops, fmt, values: torch.Tensor, slots: torch.Tensor, tensor_scale: float):
    """qkv_rope_store with K = 0 (no RoPE/norm effect worth testing here) and V = `values`."""
    tokens, kv_heads, dim = values.shape
    heads = kv_heads
    qkv = torch.cat([torch.zeros(tokens, 2 * heads * dim), values.reshape(tokens, -1)], dim=1).contiguous()
    cos, sin = torch.ones(tokens, dim // 2), torch.zeros(tokens, dim // 2)
    num_slots = int(slots.max()) + 1
    pools = [torch.zeros(num_slots, kv_heads, dim, dtype=torch.uint8) for _ in range(2)]
    exps = [torch.zeros(num_slots, kv_heads, dtype=torch.uint8) for _ in range(2)]
    q_out = torch.empty(tokens, heads * dim)
    ops.qkv_rope_store(
        qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), slots.data_ptr(), None, None, q_out.data_ptr(),
        pools[0].data_ptr(), pools[1].data_ptr(), fmt.code, tokens, heads, kv_heads, dim, 1e-6,
        exps[0].data_ptr(), exps[1].data_ptr(), tensor_scale, tensor_scale, THREADS,
    )  # fmt: skip
    return pools, exps


@pytest.mark.parametrize("tensor_scale", [0.0, 0.37])
@pytest.mark.parametrize("name", FORMAT_NAMES)
def test_store_writes_the_oracles_codes_and_scales_exactly(ops, name, tensor_scale):
    fmt = FORMATS[name]
    tokens, kv_heads, dim = 40, 2, 64
    values = wide_range_values((tokens, kv_heads, dim), seed=len(name))
    if tensor_scale:  # one checkpoint scale for every value: keep them in a range it suits
        values = values.clamp(-1000, 1000)
    slots = torch.randperm(tokens + 10)[:tokens]
    slots[3] = -1  # padding: stores nothing
    pools, exps = store(ops, fmt, values, slots, tensor_scale)
    keep = slots >= 0
    want_codes, want_bytes = quantize(values[keep], fmt, tensor_scale)
    assert torch.equal(pools[1][slots[keep]], want_codes)
    assert torch.equal(exps[1][slots[keep]], want_bytes)
    # and every stored value is within half a code step of the input (saturation aside)
    decoded = dequantize(want_codes, want_bytes, fmt, tensor_scale)
    assert torch.isfinite(decoded).all()


@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_e5m2"])
def test_every_fp8_code_round_trips_through_the_store(ops, name):
    """All finite codes stored at scale 1 come back as the same byte: the encoder is exact on
    representable values, subnormals and both zeros included."""
    fmt = FORMATS[name]
    codes = torch.arange(256, dtype=torch.uint8)
    values = codes.view(fmt.torch_dtype).float()
    finite = torch.isfinite(values) & (values.abs() <= fmt.qmax)
    values = values[finite]
    values = torch.cat([values, torch.zeros(-values.numel() % 16)]).reshape(-1, 1, 16)
    slots = torch.arange(values.shape[0])
    pools, _ = store(ops, fmt, values, slots, 1.0)
    assert torch.equal(pools[1].view(fmt.torch_dtype).float(), values)


@pytest.mark.parametrize("heads,kv_heads,dim", [(8, 4, 64), (4, 1, 32), (6, 2, 48), (2, 1, 128)])
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("name", FORMAT_NAMES)
def test_attention_over_quantized_pools_matches_the_dequantized_reference(
    ops, name, heads, kv_heads, dim, block_size
):
    """Decode rows, a whole prompt and a mid-sequence chunk (tile path), over codes and scale
    bytes in shuffled blocks; head_dim 48 takes the non-vector path."""
    fmt = FORMATS[name]
    rng = random.Random(dim + block_size)
    q_lens, ctx_lens = [13, 5, 1, 1, 0, 1], [13, 40, 77, 1, 9, 33]
    query, k_cache, v_cache, tables, seq_lens, qsl = random_paged_batch(
        rng, q_lens, ctx_lens, heads, kv_heads, dim, block_size
    )
    k_cache = k_cache * torch.pow(10.0, torch.empty(k_cache.shape[:-1]).uniform_(-0.5, 0.5))[..., None]
    (k_codes, k_bytes), (v_codes, v_bytes) = (quantize(pool, fmt) for pool in (k_cache, v_cache))
    out = torch.full_like(query, float("nan"))
    scale = dim**-0.5
    status = ops.paged_attention(
        out.data_ptr(), query.data_ptr(), k_codes.data_ptr(), v_codes.data_ptr(), fmt.code,
        k_bytes.data_ptr(), v_bytes.data_ptr(), 0.0, 0.0, tables.data_ptr(), tables.shape[1],
        seq_lens.data_ptr(), qsl.data_ptr(), len(seq_lens), heads, kv_heads, dim, block_size, scale, 0,
        THREADS,
    )  # fmt: skip
    assert status == 0
    want = CpuAttentionBackend().paged_attention(
        query, dequantize(k_codes, k_bytes, fmt), dequantize(v_codes, v_bytes, fmt), tables, seq_lens, qsl,
        scale, max(q_lens), max(ctx_lens),
    )  # fmt: skip
    torch.testing.assert_close(out, want, rtol=2e-5, atol=2e-5)


def test_attention_applies_the_checkpoints_tensor_scales(ops):
    fmt = FORMATS["fp8_e4m3"]
    heads, kv_heads, dim, block_size = 4, 2, 64, 8
    query, k_cache, v_cache, tables, seq_lens, qsl = random_paged_batch(
        random.Random(3), [1, 6], [30, 20], heads, kv_heads, dim, block_size
    )
    k_scale, v_scale = 0.05, 0.02
    (k_codes, k_bytes), (v_codes, v_bytes) = (
        quantize(pool, fmt, s) for pool, s in ((k_cache, k_scale), (v_cache, v_scale))
    )
    assert (k_bytes == SCALE_ONE).all() and (scale_of(k_bytes) == 1.0).all()
    out = torch.empty_like(query)
    status = ops.paged_attention(
        out.data_ptr(), query.data_ptr(), k_codes.data_ptr(), v_codes.data_ptr(), fmt.code,
        k_bytes.data_ptr(), v_bytes.data_ptr(), k_scale, v_scale, tables.data_ptr(), tables.shape[1],
        seq_lens.data_ptr(), qsl.data_ptr(), 2, heads, kv_heads, dim, block_size, dim**-0.5, 0, THREADS,
    )  # fmt: skip
    assert status == 0
    want = CpuAttentionBackend().paged_attention(
        query, dequantize(k_codes, k_bytes, fmt, k_scale), dequantize(v_codes, v_bytes, fmt, v_scale),
        tables, seq_lens, qsl, dim**-0.5, 6, 30,
    )  # fmt: skip
    torch.testing.assert_close(out, want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("name", FORMAT_NAMES)
def test_the_scale_byte_is_the_smallest_that_fits_the_amax(name):
    """Every byte's scale is exact (1 + m/8) 2^(e - 20); the byte of an amax is the smallest
    whose scale times qmax reaches the fp32 quotient amax / qmax, clamped to the byte's range."""
    fmt = FORMATS[name]
    byte = torch.arange(256, dtype=torch.uint8)
    e, m = (byte.int() >> 3).double(), (byte.int() & 7).double()
    assert torch.equal(scale_of(byte).double(), (1 + m / 8) * torch.pow(2.0, e - 20))
    gen = torch.Generator().manual_seed(5)
    amax = torch.pow(10.0, torch.empty(20000).uniform_(-9, 8, generator=gen))
    amax = torch.cat([amax, scale_of(byte) * fmt.qmax])  # exactly on a scale: that byte itself
    got = scale_bytes(amax, fmt)
    quotient = amax / fmt.qmax
    inside = (quotient > scale_of(torch.tensor([0], dtype=torch.uint8))) & (quotient <= scale_of(byte[-1:]))
    assert (scale_of(got[inside]) >= quotient[inside]).all()
    below = got[inside].int() - 1
    assert (scale_of(below[below >= 0].to(torch.uint8)) < quotient[inside][below >= 0]).all()
    assert (got[quotient <= scale_of(byte[:1])] == 0).all() and (
        got[quotient > scale_of(byte[-1:])] == 255
    ).all()
    assert torch.equal(scale_bytes(scale_of(byte) * fmt.qmax, fmt), byte)
