"""A linear layer's weight as a GGUF file stores it: each output row a run of ggml quant blocks,
held packed exactly as read (never dequantized at load), so resident bytes equal the file's.

    data uint8 [N, K / block_size * type_size]      row n = blocks of W[n, 0:K]

`ggml_type` is a `gguf.GGMLQuantizationType` value; block_size and type_size come from
`gguf.constants.GGML_QUANT_SIZES` (Q4_0: 32 weights in 18 bytes, Q4_K: 256 in 144, ...). The
block layouts are llama.cpp's (ggml-common.h); `gguf.quants.dequantize` (llama.cpp's own
reference, in numpy) is the oracle every decoder here is tested against.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from torch import Tensor


@dataclass
class GgufBlockWeight:
    data: Tensor  # uint8 [N, bytes_per_row]
    ggml_type: int
    shape: tuple[int, int]  # (N, K) of the dense weight

    @property
    def type_name(self) -> str:
        return GGMLQuantizationType(self.ggml_type).name

    @property
    def block_geometry(self) -> tuple[int, int]:
        """(weights per block, bytes per block)."""
        return GGML_QUANT_SIZES[GGMLQuantizationType(self.ggml_type)]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """The dense [N, K] weight, through llama.cpp's numpy reference (load-time fallback and
        tests; never on the fast path)."""
        from gguf.quants import dequantize

        dense = dequantize(self.data.numpy(), GGMLQuantizationType(self.ggml_type))
        return torch.from_numpy(np.ascontiguousarray(dense, dtype=np.float32)).reshape(self.shape).to(dtype)

    def check(self, name: str) -> None:
        """Row bytes agree with the shape and type; raises ValueError naming `name`."""
        n, k = self.shape
        block, size = self.block_geometry
        if k % block:
            raise ValueError(f"{name}: {self.type_name} needs K a multiple of {block}, got K={k}")
        want = (n, k // block * size)
        if self.data.dtype != torch.uint8 or tuple(self.data.shape) != want:
            raise ValueError(
                f"{name}: {self.type_name} data {tuple(self.data.shape)} {self.data.dtype} does not fit "
                f"shape {self.shape} (want uint8 {want})"
            )

    @property
    def packed_bytes(self) -> int:
        return self.data.numel()


def concat_block_rows(weights: list[GgufBlockWeight]) -> GgufBlockWeight:
    """Layers of the same input stacked along N (fused q|k|v, gate|up): one type, one K."""
    first = weights[0]
    if any(w.ggml_type != first.ggml_type or w.shape[1] != first.shape[1] for w in weights):
        names = sorted({w.type_name for w in weights})
        raise ValueError(f"cannot fuse GGUF layers of different types or widths ({', '.join(names)})")
    rows = sum(w.shape[0] for w in weights)
    return GgufBlockWeight(torch.cat([w.data for w in weights]), first.ggml_type, (rows, first.shape[1]))
