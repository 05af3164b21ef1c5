"""Multimodal rotary positions (M-RoPE), as Qwen3-VL computes them.

Each token has three rotary positions (t, h, w) (base/vision.py explains how a prompt's images
set them). The head's rotary frequencies are shared out among the axes: with Qwen3-VL's
interleaved layout, frequency j rotates by

    h  if j % 3 == 1 and j < 3 * section[1]
    w  if j % 3 == 2 and j < 3 * section[2]
    t  otherwise

(`mrope_section` from the checkpoint's rope parameters). A text token has t = h = w, so its
angles are plain RoPE's at that position: decode steps need only the sequence's shift.
"""

from __future__ import annotations

import numpy as np
import torch

from base.vision import ImageSpan


def rope_positions(spans: list[ImageSpan], start: int, end: int) -> np.ndarray:
    """int64 [3, end - start]: the (t, h, w) rotary positions of KV positions [start, end) of a
    prompt whose images sit at `spans` (sorted, disjoint), as Hugging Face's Qwen3-VL
    `get_rope_index`; positions after the last image continue as text (also past the prompt)."""
    positions = np.empty((3, end - start), dtype=np.int64)
    shift = 0  # rotary minus KV position for text after the images passed so far
    text_from = 0
    for span in spans:
        _fill_text(positions, start, end, text_from, span.offset, shift)
        rope_start = span.offset + shift
        lo, hi = max(start, span.offset), min(end, span.end)
        if lo < hi:
            index = np.arange(lo - span.offset, hi - span.offset, dtype=np.int64)
            positions[0, lo - start : hi - start] = rope_start
            positions[1, lo - start : hi - start] = rope_start + index // span.cols
            positions[2, lo - start : hi - start] = rope_start + index % span.cols
        shift = rope_start + max(span.rows, span.cols) - span.end
        text_from = span.end
    _fill_text(positions, start, end, text_from, end, shift)
    return positions


def _fill_text(positions: np.ndarray, start: int, end: int, lo: int, hi: int, shift: int) -> None:
    lo, hi = max(lo, start), min(hi, end)
    if lo < hi:
        positions[:, lo - start : hi - start] = np.arange(lo + shift, hi + shift, dtype=np.int64)


def axis_of_frequency(num_freqs: int, section: tuple[int, int, int], interleaved: bool) -> torch.Tensor:
    """int64 [num_freqs]: which of (t, h, w) drives each rotary frequency."""
    axis = torch.zeros(num_freqs, dtype=torch.int64)
    if interleaved:
        axis[1 : 3 * section[1] : 3] = 1
        axis[2 : 3 * section[2] : 3] = 2
    else:  # Qwen2-VL / Qwen2.5-VL: contiguous chunks t | h | w
        axis[section[0] : section[0] + section[1]] = 1
        axis[section[0] + section[1] :] = 2
    return axis


class MRotaryEmbedding:
    """cos/sin [T, head_dim] from positions [3, T]; the same "rotate half" application as
    worker.rotary, so the decoder layers need not know which kind they were given."""

    def __init__(self, inv_freq: torch.Tensor, section: tuple[int, int, int], interleaved: bool) -> None:
        self.inv_freq = inv_freq
        if sum(section) != inv_freq.shape[0]:
            raise ValueError(f"mrope_section {section} must sum to head_dim / 2 = {inv_freq.shape[0]}")
        self.axis = axis_of_frequency(inv_freq.shape[0], section, interleaved).to(inv_freq.device)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: int64 [3, T] (or [T] for text-only rows: all axes equal)."""
        if positions.dim() == 1:
            positions = positions.expand(3, -1)
        # freqs[a, t, j] = position on axis a of token t * inv_freq[j]; pick axis(j) per j.
        freqs = positions[..., None].to(torch.float32) * self.inv_freq[None, None, :]
        picked = freqs.gather(0, self.axis.view(1, 1, -1).expand(1, freqs.shape[1], -1))[0]
        angles = torch.cat((picked, picked), dim=-1)
        return angles.cos().to(dtype), angles.sin().to(dtype)
