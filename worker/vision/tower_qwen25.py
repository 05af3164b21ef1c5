"""The Qwen2.5-VL vision tower. Beside Qwen3-VL's (worker/vision/tower.py) it differs in:

  - no learned position table and no DeepStack; RMSNorm instead of LayerNorm; a gated SiLU MLP;
  - windowed attention: except in `fullatt_block_indexes`, a patch attends only within its
    window of `window_size` pixels (ws x ws merged tokens). The patches are reordered window by
    window once, before the blocks (whole merge squares move together), and the merger's
    output is put back in merge-square order at the end:

        merged grid 3 x 5, ws = 2:   windows  A A B B C     order: A(0 1 5 6) B(2 3 7 8) C(4 9)
                                              A A B B C            D(10 11) E(12 13) F(14)
                                              D D E E F

Parameter names follow the checkpoint's `visual.*`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from worker.model import RMSNorm
from worker.vision.config import VisionConfig
from worker.vision.tower import PatchEmbed, VisionAttention, patch_coordinates, vision_rotary


class GatedMLP(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=True)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=True)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=True)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class WindowBlock(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.norm1 = RMSNorm(config.hidden_size, 1e-6)
        self.norm2 = RMSNorm(config.hidden_size, 1e-6)
        self.attn = VisionAttention(config)
        self.mlp = GatedMLP(config)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, lengths: list[int]) -> Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, lengths)
        return x + self.mlp(self.norm2(x))


class Merger(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.folded = config.hidden_size * config.spatial_merge_size**2
        self.ln_q = RMSNorm(config.hidden_size, 1e-6)
        self.mlp = nn.Sequential(
            nn.Linear(self.folded, self.folded), nn.GELU(), nn.Linear(self.folded, config.out_hidden_size)
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.mlp(self.ln_q(x).reshape(-1, self.folded))


class WindowedVisionTower(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.config = config
        self.patch_embed = PatchEmbed(config, bias=False)
        self.blocks = nn.ModuleList(WindowBlock(config) for _ in range(config.depth))
        self.merger = Merger(config)

    def forward(self, patches: Tensor, grids: list[tuple[int, int, int]]) -> tuple[Tensor, list[Tensor]]:
        """As worker.vision.tower.VisionTower.forward, with no DeepStack features."""
        unit = self.config.spatial_merge_size**2
        order, window_lengths = self._windows(grids)
        order = order.to(patches.device)
        rows, cols = patch_coordinates(grids, self.config.spatial_merge_size, patches.device)
        x = _by_square(self.patch_embed(patches), order, unit)
        cos, sin = (_by_square(t, order, unit) for t in vision_rotary(rows, cols, self.config))
        image_lengths = [t * h * w for t, h, w in grids]
        for i, block in enumerate(self.blocks):
            full = i in self.config.fullatt_block_indexes
            x = block(x, cos, sin, image_lengths if full else window_lengths)
        merged = self.merger(x)
        return merged[torch.argsort(order)], []

    def _windows(self, grids) -> tuple[Tensor, list[int]]:
        """Merge-square indices in window order, and each window's length in patches."""
        merge = self.config.spatial_merge_size
        side = self.config.window_size // merge // self.config.patch_size  # merged tokens per window side
        order, lengths, first = [], [], 0
        for t, h, w in grids:
            gh, gw = h // merge, w // merge
            index = torch.arange(t * gh * gw).view(t, gh, gw) + first
            for frame in range(t):
                for r in range(0, gh, side):
                    for c in range(0, gw, side):
                        window = index[frame, r : r + side, c : c + side].reshape(-1)
                        order.append(window)
                        lengths.append(window.numel() * merge * merge)
            first += t * gh * gw
        return torch.cat(order), lengths


def _by_square(x: Tensor, order: Tensor, unit: int) -> Tensor:
    """Rows of x regrouped so merge square order[i] comes i-th (a square's patches stay together)."""
    return x.reshape(-1, unit, x.shape[-1])[order].reshape(-1, x.shape[-1])
