"""The one representation every quantized checkpoint format decodes into, and every kernel
packs from: unsigned integer codes with a scale and an integer zero point per group.

    W[n, k] = (codes[n, k] - zeros[n, k // group]) * scales[n, k // group]

codes uint8 [N, K] in [0, 2^bits); scales [N, G] in the checkpoint's float dtype (kept exactly:
the kernels widen them in registers); zeros uint8 [N, G] (2^(bits-1) for symmetric schemes,
so a signed int8 weight q is stored as q + 128). G = K // group (one group = the whole row
for per-channel schemes). The dequantized value is exact in fp32 for every format here
(an fp16/bf16 scale times a small integer fits in fp32's 24-bit mantissa).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class QuantizedWeight:
    codes: Tensor  # uint8 [N, K]
    scales: Tensor  # float16 / bfloat16 / float32 [N, G]
    zeros: Tensor  # uint8 [N, G]
    bits: int
    group_size: int  # K // G

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """The dense [N, K] weight (for the reference forward and tests; never on the fast path)."""
        group = self.group_size
        q = self.codes.to(torch.float32) - self.zeros.to(torch.float32).repeat_interleave(group, dim=1)
        return (q * self.scales.to(torch.float32).repeat_interleave(group, dim=1)).to(dtype)

    def check(self, name: str) -> None:
        """Internal consistency (shapes, dtypes, code range); raises ValueError naming `name`."""
        n, k = self.codes.shape
        if self.codes.dtype != torch.uint8 or self.zeros.dtype != torch.uint8:
            raise ValueError(f"{name}: codes and zeros must be uint8")
        if (
            k % self.group_size
            or self.scales.shape != (n, k // self.group_size)
            or self.zeros.shape != self.scales.shape
        ):
            shape = tuple(self.scales.shape)
            raise ValueError(
                f"{name}: scales/zeros {shape} do not fit codes {(n, k)} in groups of {self.group_size}"
            )
        top = 1 << self.bits  # a GPTQ v1 zero may be 2^bits (stored zero - 1 wrapped)
        if int(self.codes.max()) >= top or int(self.zeros.max()) > top:
            raise ValueError(f"{name}: codes outside [0, {top}) or zeros outside [0, {top}]")

    @property
    def packed_bytes(self) -> int:
        """Bytes the kernels hold for it: codes at `bits` each, scales, zeros."""
        n, k = self.codes.shape
        return n * k * self.bits // 8 + self.scales.numel() * self.scales.element_size() + self.zeros.numel()


def concat_rows(weights: list[QuantizedWeight]) -> QuantizedWeight:
    """Layers of the same input stacked along N (fused q|k|v, gate|up): same bits and groups."""
    first = weights[0]
    if any(w.bits != first.bits or w.group_size != first.group_size or w.scales.dtype != first.scales.dtype
           for w in weights):  # fmt: skip
        raise ValueError("cannot fuse quantized layers with different bits, groups or scale dtypes")
    return QuantizedWeight(
        torch.cat([w.codes for w in weights]),
        torch.cat([w.scales for w in weights]),
        torch.cat([w.zeros for w in weights]),
        first.bits,
        first.group_size,
    )
