"""GGUF block weights on the fast CPU forward: the one place that turns a linear's parts
(GgufBlockWeights, or dense tensors of a partly quantized fused q|k|v or gate|up) into a kernel.

Until the GGUF block kernels land (issue 39's other half), the blocks are dequantized here, at
load, into a PanelLinear of the compute dtype: exact values through llama.cpp's reference
dequantizer, but the resident bytes of a dense model. `FastCpuForward` logs that once.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kernels.cpu_build import CpuOps
from worker.cpu_weights import PanelLinear
from worker.quant.gguf_weight import GgufBlockWeight


def gguf_linear(ops: CpuOps, parts: list[GgufBlockWeight | Tensor], bias: Tensor | None, dtype: torch.dtype):
    """y = x W^T + b for W = the parts stacked along N (each [N_i, K]); PanelLinear's interface,
    `gather_rows` included (a tied GGUF embedding is looked up through its lm_head's kernel)."""
    dense = [p.dequantize(torch.float32) if isinstance(p, GgufBlockWeight) else p.detach() for p in parts]
    return PanelLinear(ops, torch.cat(dense) if len(dense) > 1 else dense[0], bias, dtype)
