"""The one representation every quantized checkpoint format decodes into, and every kernel
packs from: unsigned integer codes with a scale and an integer zero point per group.

    W[n, k] = (codes[n, k] - zeros[n, k // group]) * scales[n, k // group]

codes uint8 [N, K] in [0, 2^bits); scales [N, G] in the checkpoint's float dtype (kept exactly:
the kernels widen them in registers); zeros uint8 [N, G] (2^(bits-1) for symmetric schemes,
so a signed int8 weight q is stored as q + 128). G = K // group (one group = the whole row
for per-channel schemes). The dequantized value is exact in fp32 for every format here
(an fp16/bf16 scale times a small integer fits in fp32's 24-bit mantissa).

act_bits says what the layer's inputs are rounded to: 16 for the weight-only formats (the CPU
kernels' int16 codes per block of <= 128 inputs, within ~1e-4 of the dequantized layer), 8 for
W8A8 checkpoints, whose format defines int8 activations with one dynamic scale per token
(worker/quant/activations.py): every forward rounds their inputs so, the fast CPU kernels in
integer dot products, the reference and CUDA forwards by fake quantization.
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
    act_bits: int = 16  # 16: weight-only; 8: int8 activations per token (W8A8)

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
           or w.act_bits != first.act_bits for w in weights):  # fmt: skip
        raise ValueError("cannot fuse quantized layers of other bits, groups, scale dtypes or activations")
    return QuantizedWeight(
        torch.cat([w.codes for w in weights]),
        torch.cat([w.scales for w in weights]),
        torch.cat([w.zeros for w in weights]),
        first.bits,
        first.group_size,
        first.act_bits,
    )
