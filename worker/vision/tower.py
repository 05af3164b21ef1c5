"""The Qwen3-VL vision tower: patches -> language-model-sized tokens, plus DeepStack features.

    patches [N, C*T*P*P] ── patch_embed (a Conv3d whose stride is its kernel: one GEMM)
      + learned position embedding, bilinearly resampled from a square table to the image's grid
      ── blocks (LayerNorm, full bidirectional attention within each image with 2-D rotary
         (row, col) positions, LayerNorm, GELU-tanh MLP)
           after block i in deepstack_visual_indexes: a merger of its own -> DeepStack feature k
      ── merger (LayerNorm, fold merge x merge patches into one row, fc1, GELU, fc2)
    -> tokens [N / merge^2, text hidden], features k = 0.. [N / merge^2, text hidden]

Several images run as one batch (their patches concatenated, attention split per image).
Parameter names follow the checkpoint's `model.visual.*` so it loads by name. Pure torch: the
same code runs on the CPU and on CUDA.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from worker.vision.config import VisionConfig


class PatchEmbed(nn.Module):
    def __init__(self, config: VisionConfig, bias: bool = True) -> None:
        super().__init__()
        kernel = (config.temporal_patch_size, config.patch_size, config.patch_size)
        self.proj = nn.Conv3d(config.in_channels, config.hidden_size, kernel, stride=kernel, bias=bias)

    def forward(self, patches: Tensor) -> Tensor:
        weight = self.proj.weight
        return F.linear(patches.to(weight.dtype), weight.reshape(weight.shape[0], -1), self.proj.bias)


class VisionAttention(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.head_dim = config.hidden_size // config.num_heads
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size, bias=True)
        self.proj = nn.Linear(config.hidden_size, config.hidden_size, bias=True)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, lengths: list[int]) -> Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, self.head_dim).unbind(1)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        outputs = []
        for qi, ki, vi in zip(q.split(lengths), k.split(lengths), v.split(lengths), strict=True):
            # [heads, len, dim]: each image attends only to itself, no mask, no causality
            out = F.scaled_dot_product_attention(qi.transpose(0, 1), ki.transpose(0, 1), vi.transpose(0, 1))
            outputs.append(out.transpose(0, 1).reshape(-1, self.num_heads * self.head_dim))
        return self.proj(torch.cat(outputs))


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotary in fp32 (as the reference does), back to x's dtype."""
    x32 = x.float()
    half = x.shape[-1] // 2
    rotated = torch.cat((-x32[..., half:], x32[..., :half]), dim=-1)
    return (x32 * cos[:, None, :] + rotated * sin[:, None, :]).to(x.dtype)


class VisionMLP(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(config.hidden_size, config.intermediate_size, bias=True)
        self.linear_fc2 = nn.Linear(config.intermediate_size, config.hidden_size, bias=True)
        self.approximate = "tanh" if config.hidden_act == "gelu_pytorch_tanh" else "none"

    def forward(self, x: Tensor) -> Tensor:
        return self.linear_fc2(F.gelu(self.linear_fc1(x), approximate=self.approximate))


class VisionBlock(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(config.hidden_size, eps=1e-6)
        self.norm2 = nn.LayerNorm(config.hidden_size, eps=1e-6)
        self.attn = VisionAttention(config)
        self.mlp = VisionMLP(config)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, lengths: list[int]) -> Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, lengths)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """merge x merge consecutive patch rows -> one token. The main merger normalizes each patch
    before folding; DeepStack's mergers normalize the folded row (`post_shuffle_norm`)."""

    def __init__(self, config: VisionConfig, post_shuffle_norm: bool) -> None:
        super().__init__()
        self.folded = config.hidden_size * config.spatial_merge_size**2
        self.post_shuffle_norm = post_shuffle_norm
        self.norm = nn.LayerNorm(self.folded if post_shuffle_norm else config.hidden_size, eps=1e-6)
        self.linear_fc1 = nn.Linear(self.folded, self.folded)
        self.linear_fc2 = nn.Linear(self.folded, config.out_hidden_size)

    def forward(self, x: Tensor) -> Tensor:
        x = self.norm(x.reshape(-1, self.folded)) if self.post_shuffle_norm else self.norm(x)
        return self.linear_fc2(F.gelu(self.linear_fc1(x.reshape(-1, self.folded))))


class VisionTower(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.config = config
        self.patch_embed = PatchEmbed(config)
        self.pos_embed = nn.Embedding(config.num_position_embeddings, config.hidden_size)
        self.blocks = nn.ModuleList(VisionBlock(config) for _ in range(config.depth))
        self.merger = PatchMerger(config, post_shuffle_norm=False)
        self.deepstack_merger_list = nn.ModuleList(
            PatchMerger(config, post_shuffle_norm=True) for _ in config.deepstack_visual_indexes
        )

    def forward(self, patches: Tensor, grids: list[tuple[int, int, int]]) -> tuple[Tensor, list[Tensor]]:
        """patches [N, C*T*P*P] of all images (preprocess order), grids (t, h, w) per image ->
        (tokens [N / merge^2, out], DeepStack features, one [N / merge^2, out] per index)."""
        rows, cols = patch_coordinates(grids, self.config.spatial_merge_size, patches.device)
        x = self.patch_embed(patches)
        x = x + self._position_embedding(rows, cols, grids).to(x.dtype)
        cos, sin = vision_rotary(rows, cols, self.config)
        lengths = [t * h * w for t, h, w in grids]
        features = []
        indexes = self.config.deepstack_visual_indexes
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, lengths)
            if i in indexes:
                features.append(self.deepstack_merger_list[indexes.index(i)](x))
        return self.merger(x), features

    def _position_embedding(self, rows: Tensor, cols: Tensor, grids) -> Tensor:
        """The square table (side x side) resampled to each image's h x w grid, bilinear with
        aligned corners: the corner patches take the table's corner entries exactly."""
        side = int(self.config.num_position_embeddings**0.5)
        heights = torch.cat([torch.full((t * h * w,), h, device=rows.device) for t, h, w in grids])
        widths = torch.cat([torch.full((t * h * w,), w, device=rows.device) for t, h, w in grids])
        r_taps, r_weights = _bilinear_taps(rows, heights, side)
        c_taps, c_weights = _bilinear_taps(cols, widths, side)
        index = (r_taps[:, :, None] * side + c_taps[:, None, :]).reshape(-1, 4)
        weight = (r_weights[:, :, None] * c_weights[:, None, :]).reshape(-1, 4)
        return (self.pos_embed(index) * weight[:, :, None].to(self.pos_embed.weight.dtype)).sum(1)


def patch_coordinates(grids, merge: int, device) -> tuple[Tensor, Tensor]:
    """(row, col) of every patch in its image's grid, in preprocess order (merge squares)."""
    rows, cols = [], []
    for t, h, w in grids:
        r = (
            torch.arange(h, device=device)
            .view(h // merge, merge, 1, 1)
            .expand(h // merge, merge, w // merge, merge)
        )
        c = (
            torch.arange(w, device=device)
            .view(1, 1, w // merge, merge)
            .expand(h // merge, merge, w // merge, merge)
        )
        rows.append(r.transpose(1, 2).reshape(-1).repeat(t))
        cols.append(c.transpose(1, 2).reshape(-1).repeat(t))
    return torch.cat(rows), torch.cat(cols)


def vision_rotary(rows: Tensor, cols: Tensor, config: VisionConfig) -> tuple[Tensor, Tensor]:
    """fp32 cos/sin [N, head_dim]: the first quarter of frequencies rotate by row, the second by
    column, both halves repeated (head_dim / 4 frequencies per axis)."""
    spatial = config.hidden_size // config.num_heads // 2
    exponents = torch.arange(0, spatial, 2, dtype=torch.float32, device=rows.device) / spatial
    inv_freq = 1.0 / (config.rope_theta**exponents)
    freqs = torch.cat((rows[:, None].float() * inv_freq, cols[:, None].float() * inv_freq), dim=-1)
    angles = torch.cat((freqs, freqs), dim=-1)
    return angles.cos(), angles.sin()


def _bilinear_taps(index: Tensor, size: Tensor, side: int) -> tuple[Tensor, Tensor]:
    """The two source entries (clamped to the table) and their weights for target positions
    `index` on an axis of `size` cells mapped onto `side` entries, corners aligned."""
    src = index.float() * (side - 1) / torch.clamp(size - 1, min=1).float()
    floor = torch.floor(src)
    offsets = torch.arange(2, device=index.device)
    taps = (floor.long()[:, None] + offsets).clamp(0, side - 1)
    weights = (1 - (src[:, None] - floor[:, None] - offsets).abs()).clamp(min=0)
    return taps, weights
