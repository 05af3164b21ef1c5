"""GGUF block weights for tests: dense weights encoded as ggml blocks. gguf.quants.quantize
(llama.cpp's numpy port) encodes Q8_0 / Q4_0 / Q4_1; it has no K-quant encoder, so Q4_K / Q5_K /
Q6_K are encoded here by a plain absmax / min-max rounding (not llama.cpp's search for the best
scales: a test needs valid blocks close to the weight, not the best ones). The layouts are
checked the other way round: gguf.quants.dequantize of these blocks must land within the
rounding step of the dense weight (`encode` asserts it), so a packing error cannot pass."""

from __future__ import annotations

import numpy as np
import torch
from gguf.constants import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize

from worker.quant.gguf_weight import GgufBlockWeight


def _f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).view(np.uint8).reshape(*x.shape[:-1], 2 * x.shape[-1])


def _pack_scales_k4(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """[B, 8] 6-bit scales and mins -> ggml's 12-byte get_scale_min_k4 packing."""
    out = np.zeros((sc.shape[0], 12), np.uint8)
    out[:, 0:4] = (sc[:, 0:4] & 63) | ((sc[:, 4:8] >> 4) << 6)
    out[:, 4:8] = (mn[:, 0:4] & 63) | ((mn[:, 4:8] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:8] & 0xF) | ((mn[:, 4:8] & 0xF) << 4)
    return out


def _encode_k45(x: np.ndarray, bits: int) -> np.ndarray:
    """[B, 256] -> Q4_K (bits 4) or Q5_K (bits 5) blocks: w = d sc q - dmin mn per 32."""
    top = (1 << bits) - 1
    sub = x.reshape(-1, 8, 32)
    lo = np.minimum(sub.min(-1), 0.0)
    step = (sub.max(-1) - lo) / top
    d = (step.max(-1, keepdims=True) / 63).astype(np.float16).astype(np.float32)
    dmin = (-lo.min(-1, keepdims=True) / 63).astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(np.divide(step, d, out=np.zeros_like(step), where=d > 0)), 1, 63).astype(np.uint8)
    mn = np.clip(np.round(np.divide(-lo, dmin, out=np.zeros_like(lo), where=dmin > 0)), 0, 63).astype(
        np.uint8
    )
    scale = (d * sc)[..., None]
    q = np.clip(np.round((sub + (dmin * mn)[..., None]) / np.where(scale > 0, scale, 1)), 0, top).astype(
        np.uint8
    )
    q = q.reshape(-1, 4, 2, 32)  # sub-block 2c + nibble
    qs = (q[:, :, 0] & 0xF) | ((q[:, :, 1] & 0xF) << 4)
    head = [_f16(d), _f16(dmin), _pack_scales_k4(sc, mn)]
    if bits == 5:
        high = (q.reshape(-1, 8, 32) >> 4).astype(np.uint8)
        qh = np.zeros((q.shape[0], 32), np.uint8)
        for j in range(8):
            qh |= high[:, j] << j
        head.append(qh)
    return np.concatenate([*head, qs.reshape(-1, 128)], axis=1)


def _encode_q6_k(x: np.ndarray) -> np.ndarray:
    """[B, 256] -> Q6_K blocks: w = d sc (q - 32) per 16, sc int8."""
    sub = x.reshape(-1, 16, 16)
    step = np.abs(sub).max(-1) / 31
    d = (step.max(-1, keepdims=True) / 127).astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(np.divide(step, d, out=np.zeros_like(step), where=d > 0)), 1, 127).astype(np.int8)
    scale = (d * sc)[..., None]
    q = (
        (np.clip(np.round(sub / scale), -32, 31) + 32).astype(np.uint8).reshape(-1, 2, 2, 2, 32)
    )  # [B, h, t, u, l]
    ql = (q[:, :, 0] & 0xF) | ((q[:, :, 1] & 0xF) << 4)  # [B, h, u, l]: nibble t
    hi = (q >> 4).reshape(-1, 2, 4, 32)  # [B, h, s = 2t + u, l]
    qh = hi[:, :, 0] | (hi[:, :, 1] << 2) | (hi[:, :, 2] << 4) | (hi[:, :, 3] << 6)
    return np.concatenate([ql.reshape(-1, 128), qh.reshape(-1, 64), sc.view(np.uint8), _f16(d)], axis=1)


def encode(weight: torch.Tensor, qtype: T) -> GgufBlockWeight:
    """A dense [N, K] weight as `qtype` blocks (K a multiple of the type's block)."""
    dense = weight.detach().float().numpy()
    n, k = dense.shape
    if qtype in (T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1):
        raw = quantize(dense, qtype)
    else:
        blocks = dense.reshape(-1, 256)
        raw = {
            T.Q4_K: lambda b: _encode_k45(b, 4),
            T.Q5_K: lambda b: _encode_k45(b, 5),
            T.Q6_K: _encode_q6_k,
        }[qtype](blocks).reshape(n, -1)
    back = dequantize(raw, qtype).reshape(n, k)
    step = np.abs(dense).max() / 4  # coarser than any type's rounding step on these weights
    assert np.abs(back - dense).max() < step, f"{qtype.name} encoding does not round-trip"
    return GgufBlockWeight(torch.from_numpy(np.ascontiguousarray(raw)), int(qtype), (n, k))
