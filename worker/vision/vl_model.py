"""Qwen3-VL and Qwen2.5-VL as the worker serves them: a vision tower plus worker.model's decoder
stack, whose paged KV cache, attention backends and decoder layers are the text models' own.

What differs from a text forward, per step (inputs from worker.vision.images):
  - image placeholder rows of the chunk take the tower's tokens instead of token embeddings;
  - rotary angles come from 3-D positions (M-RoPE), not from the KV position;
  - DeepStack (Qwen3-VL): after decoder layer k (k < number of features) the image rows add
    feature k.

Module names follow the checkpoints (Qwen3-VL: `model.language_model.*`, `model.visual.*`;
Qwen2.5-VL: `model.*`, `visual.*`; both `lm_head`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from worker.batch import AttentionMetadata
from worker.errors import ModelLoadError
from worker.kv_cache import KVCache
from worker.model import DecoderStack
from worker.model_config import ModelConfig
from worker.rotary import inverse_frequencies
from worker.vision.config import QWEN2_5_VL
from worker.vision.mrope import MRotaryEmbedding
from worker.vision.tower import VisionTower
from worker.vision.tower_qwen25 import WindowedVisionTower
from worker.weights import load_tensors


@dataclass(slots=True)
class ImageRows:
    """The rows of a step's flattened batch that hold image tokens, and what goes there."""

    rows: Tensor  # int64 [R]
    embeds: Tensor  # [R, hidden]
    deepstack: list[Tensor]  # per DeepStack layer, [R, hidden]


class VisionLanguageStack(nn.Module):
    """Qwen3-VL's `model.*`: `model.language_model.*` and `model.visual.*`."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.language_model = DecoderStack(config)
        self.visual = VisionTower(config.multimodal.vision)


class VisionLanguageLM(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        if config.multimodal is None:
            raise ValueError("VisionLanguageLM needs a multimodal config")
        self.config = config
        # The checkpoints' layouts differ: Qwen3-VL nests both under `model`, Qwen2.5-VL keeps
        # the decoder as `model.*` (a text model's names) and the tower as `visual.*`.
        if config.architecture == QWEN2_5_VL:
            self.model = DecoderStack(config)
            self.visual = WindowedVisionTower(config.multimodal.vision)
        else:
            self.model = VisionLanguageStack(config)
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )
        self.rotary: MRotaryEmbedding | None = None
        self.quantized: dict = {}  # quantized VL checkpoints are refused at load

    @property
    def language(self) -> DecoderStack:
        return self.model if isinstance(self.model, DecoderStack) else self.model.language_model

    @property
    def tower(self) -> nn.Module:
        return self.visual if isinstance(self.model, DecoderStack) else self.model.visual

    @classmethod
    def from_checkpoint(
        cls, model_dir: str | Path, config: ModelConfig, dtype: torch.dtype, device: torch.device | str
    ) -> VisionLanguageLM:
        if config.quantization is not None:
            raise ModelLoadError("quantized vision-language checkpoints are not supported")
        with torch.device("meta"):
            model = cls(config)
        shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
        model.load_state_dict(load_tensors(model_dir, shapes, dtype, device), strict=False, assign=True)
        mm = config.multimodal
        inv_freq = inverse_frequencies(config.rope, config.head_dim).to(device)
        model.rotary = MRotaryEmbedding(inv_freq, mm.mrope_section, mm.mrope_interleaved)
        return model.requires_grad_(False).eval()  # served, never trained: as CausalLM's

    def encode_images(
        self, patches: Tensor, grids: list[tuple[int, int, int]]
    ) -> tuple[Tensor, list[Tensor]]:
        """The tower over every image of a step at once: (tokens, DeepStack features)."""
        return self.tower(patches, grids)

    def forward(
        self,
        input_ids: Tensor,
        positions: Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
        images: ImageRows | None = None,
    ) -> Tensor:
        """positions: int64 [3, T] rotary positions (or [T] when every row is text)."""
        stack = self.language
        x = stack.embed_tokens(input_ids)
        if images is not None:
            x = x.index_copy(0, images.rows, images.embeds.to(x.dtype))
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        for k, layer in enumerate(stack.layers):
            x = layer(x, cos, sin, kv_cache, meta)
            if images is not None and k < len(images.deepstack):
                x = x.index_add(0, images.rows, images.deepstack[k].to(x.dtype))
        return stack.norm(x)

    def compute_logits(self, hidden: Tensor) -> Tensor:
        if self.lm_head is None:
            return F.linear(hidden, self.language.embed_tokens.weight).float()
        return self.lm_head(hidden).float()
