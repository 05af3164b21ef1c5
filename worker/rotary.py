"""Rotary position embeddings (RoPE) in the "rotate half" convention Llama and Qwen use.

For a head vector x split into halves (x1, x2) and angle a_j = position * inv_freq[j]:

    rope(x) = x * cos(a) + (-x2, x1) * sin(a),     with cos/sin duplicated over both halves.

Angles are computed in fp32 from the integer positions each step (no precomputed table),
so any position below max_model_len works and the result does not depend on how the
sequence was split into chunks. cos/sin are cast to the activation dtype before use,
which is what the reference implementation does for fp16/bf16 checkpoints.
"""

from __future__ import annotations

import math

import torch

from worker.model_config import RopeConfig


def inverse_frequencies(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """fp32 [head_dim // 2] inverse frequencies, including linear or llama3 scaling."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.scaling == "linear":
        return inv_freq / rope.factor
    if rope.scaling == "llama3":
        return _llama3_scaled(inv_freq, rope)
    return inv_freq


def _llama3_scaled(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    """Llama 3.1 frequency scaling: long wavelengths divided by `factor`, short ones kept,
    the band between interpolated smoothly."""
    old_context = rope.original_max_position_embeddings
    low_freq_wavelen = old_context / rope.low_freq_factor
    high_freq_wavelen = old_context / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_context / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding:
    """Holds the inverse frequencies on the model's device; `cos_sin` per step."""

    def __init__(self, rope: RopeConfig, head_dim: int, device: torch.device | str) -> None:
        self.inv_freq = inverse_frequencies(rope, head_dim).to(device)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin, each [T, head_dim], for int64 `positions` [T]."""
        freqs = positions[:, None].to(torch.float32) * self.inv_freq[None, :]
        angles = torch.cat((freqs, freqs), dim=-1)
        return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, num_heads, head_dim] by per-token cos/sin [T, head_dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]
