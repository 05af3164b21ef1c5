"""GGUF linear layers on the fast CPU path: the file's ggml blocks (GgufBlockWeight) read in place
by kernels/cpu_gguf.c, never dequantized (resident bytes = the file's tensor bytes). `GgufLinear`
has PanelLinear's interface (fp32 x [M, K] -> fp32 y [M, N], gather_rows, resident_bytes); the
C decoder stack calls the same kernel through PkLinear (kind PK_KIND_GGUF, w = its GgPart array).

A fused projection (q|k|v, gate|up) is one GgufLinear over several parts, which may differ in
type: Q4_K_M files keep some v / down projections in Q6_K. Types the kernels do not take (F16,
BF16, F32, Q2_K, Q3_K, IQ*...) are not GgufLinears: `gguf_linear` dequantizes those to panels."""

from __future__ import annotations

import ctypes

import torch
from gguf.constants import GGMLQuantizationType as T
from torch import Tensor

from kernels.cpu_build import CpuOps
from worker.cpu_weights import PanelLinear
from worker.quant.gguf_weight import GgufBlockWeight

NATIVE_TYPES = frozenset(
    {T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q4_K, T.Q5_K, T.Q6_K}
)  # cpu_gguf.c's decoders
NATIVE_TYPE_NAMES = frozenset(t.name for t in NATIVE_TYPES)
PK_KIND_GGUF = 64  # kernels/cpu_gguf.h


class GgPart(ctypes.Structure):
    """kernels/cpu_gguf.h GgPart: one weight matrix's rows of a (fused) linear."""

    _fields_ = [
        ("type", ctypes.c_int32),
        ("pad", ctypes.c_int32),
        ("data", ctypes.c_void_p),
        ("n", ctypes.c_int64),
    ]


class GgufLinear:
    """y = x W^T + b with W the stacked rows of `parts` as their ggml blocks (one K)."""

    def __init__(self, ops: CpuOps, parts: list[GgufBlockWeight], bias: Tensor | None) -> None:
        self.ops = ops
        self.in_features = parts[0].shape[1]
        for i, part in enumerate(parts):
            part.check(f"part {i}")
            if part.ggml_type not in NATIVE_TYPES or part.shape[1] != self.in_features:
                raise ValueError(f"GgufLinear takes {sorted(t.name for t in NATIVE_TYPES)} of one K, got "
                                 f"{part.type_name} {part.shape}")  # fmt: skip
        self.out_features = sum(p.shape[0] for p in parts)
        self.types = [p.ggml_type for p in parts]
        self.data = [p.data.contiguous() for p in parts]
        self.parts = (GgPart * len(parts))(*(GgPart(p.ggml_type, 0, d.data_ptr(), p.shape[0])
                                             for p, d in zip(parts, self.data, strict=True)))  # fmt: skip
        self.bias = None if bias is None else bias.detach().float().contiguous()

    @property
    def parts_ptr(self) -> int:
        return ctypes.addressof(self.parts)

    def __call__(self, x: Tensor, out: Tensor | None = None) -> Tensor:
        x = x.contiguous()
        rows = x.shape[0]
        y = x.new_empty(rows, self.out_features) if out is None else out
        bias = None if self.bias is None else self.bias.data_ptr()
        status = self.ops.gg_linear(
            y.data_ptr(), self.out_features, x.data_ptr(), self.in_features, self.parts_ptr, len(self.types),
            bias, rows, self.in_features, torch.get_num_threads(),
        )  # fmt: skip
        if status != 0:
            raise RuntimeError(f"gg_linear failed ({status})")
        return y

    def gather_rows(self, ids: Tensor) -> Tensor:
        """Rows W[ids] decoded to fp32 [len(ids), K]: the embedding lookup of a tied head."""
        if len(self.types) != 1:
            raise ValueError("gather_rows reads one weight matrix, not a fused linear")
        out = torch.empty(ids.shape[0], self.in_features)
        ids = ids.to(torch.int64).contiguous()
        status = self.ops.gg_dequantize_rows(
            self.types[0], out.data_ptr(), self.data[0].data_ptr(), ids.data_ptr(), ids.shape[0],
            self.in_features, torch.get_num_threads(),
        )  # fmt: skip
        if status != 0:
            raise RuntimeError(f"gg_dequantize_rows failed ({status})")
        return out

    @property
    def resident_bytes(self) -> int:
        return sum(d.numel() for d in self.data) + (0 if self.bias is None else 4 * self.bias.numel())


def gguf_linear(ops: CpuOps, parts: list[GgufBlockWeight | Tensor], bias: Tensor | None, dtype: torch.dtype):
    """The kernel for GGUF weights (one layer, or the parts of a fused one): their blocks as they
    are where every part is blocks of a native type, else dense panels of `dtype` (dequantized
    once here). A part may be a dense tensor: a fused q|k|v of which the file kept some in F16/F32."""
    blocks = all(isinstance(p, GgufBlockWeight) for p in parts)
    if blocks and all(p.ggml_type in NATIVE_TYPES for p in parts) and len({p.shape[1] for p in parts}) == 1:
        return GgufLinear(ops, parts, bias)
    dense = [p.dequantize(torch.float32) if isinstance(p, GgufBlockWeight) else p.detach().float()
             for p in parts]  # fmt: skip
    return PanelLinear(ops, torch.cat(dense), bias, dtype)
