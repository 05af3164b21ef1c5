"""Quantized linear layers on the fast CPU path: a QuantizedWeight (worker/quant/weight.py) packed
into the layout kernels/cpu_quant.c reads (its file comment draws it), held once, never
dequantized. `QuantLinear` has PanelLinear's interface (fp32 x [M, K] -> fp32 y [M, N])."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from kernels.cpu_build import CpuOps
from worker.cpu_weights import PANEL, dtype_code
from worker.quant.weight import QuantizedWeight

ACTIVATION_BLOCK = 128  # int16 activation codes per scale, at most (cpu_quant.c)


def _pad_rows(t: Tensor, rows: int) -> Tensor:
    if t.shape[0] == rows:
        return t
    out = t.new_zeros(rows, *t.shape[1:])
    out[: t.shape[0]] = t
    return out


def pack_codes(codes: Tensor, bits: int) -> Tensor:
    """uint8 codes [N, K] (K even) -> the panel layout, uint8 [N/64, K/2, 64 or 128]."""
    n, k = codes.shape
    panels = -(-n // PANEL)
    q = _pad_rows(codes, panels * PANEL)
    if bits == 4:  # column 32h + 16 lohi + i, row 2kk + j -> byte 32h + 2i + j, nibble lohi
        q = q.view(panels, 2, 2, 16, k // 2, 2).permute(0, 4, 1, 3, 5, 2)  # [P, kk, h, i, j, lohi]
        return (q[..., 0] | (q[..., 1] << 4)).reshape(panels, k // 2, 64).contiguous()
    q = q.view(panels, 4, 16, k // 2, 2).permute(0, 3, 1, 2, 4)  # [P, kk, v, i, j]
    return q.reshape(panels, k // 2, 128).contiguous()


def pack_group_params(t: Tensor) -> Tensor:
    """[N, G] per-group scales or zeros -> [N/64, G, 64] (padding columns get 0)."""
    n, groups = t.shape
    panels = -(-n // PANEL)
    return _pad_rows(t, panels * PANEL).view(panels, PANEL, groups).transpose(1, 2).contiguous()


def quantize_int8(weight: Tensor, group: int = ACTIVATION_BLOCK) -> QuantizedWeight:
    """A dense [N, K] weight as symmetric int8 codes with one fp32 scale per row and group of
    `group` input features (absmax / 127): what `--lm-head-int8` holds instead of the dense
    lm_head (llama.cpp keeps Q4_0 files' token embeddings / output at Q8_0 the same way)."""
    n, k = weight.shape
    group = math.gcd(k, group)
    w = weight.detach().float().view(n, k // group, group)
    scales = (w.abs().amax(-1) / 127).clamp(min=torch.finfo(torch.float32).tiny)
    codes = (torch.round(w / scales[..., None]).clamp(-127, 127) + 128).to(torch.uint8).view(n, k)
    return QuantizedWeight(codes, scales, torch.full_like(scales, 128, dtype=torch.uint8), 8, group)


class QuantLinear:
    """y = x W^T + b with W's integer codes, scales and zeros in the kernel's panel layout."""

    def __init__(self, ops: CpuOps, weight: QuantizedWeight, bias: Tensor | None) -> None:
        self.ops = ops
        self.out_features, self.in_features = weight.shape
        if self.in_features % 2 or weight.group_size % 2:
            raise ValueError(f"quantized layers need an even input width and group, got {weight.shape}")
        self.bits, self.group, self.act_bits = weight.bits, weight.group_size, weight.act_bits
        if self.act_bits == 8 and (self.bits != 8 or self.group != self.in_features):
            raise ValueError("int8 activations (W8A8) need 8-bit weights with one scale per output channel")
        # int16 codes per block of <= 128 inputs; W8A8: int8 codes, one block per row (cpu_quant.c)
        self.block = self.in_features if self.act_bits == 8 else math.gcd(self.group, ACTIVATION_BLOCK)
        self.codes = pack_codes(weight.codes, self.bits)
        self.scales = pack_group_params(weight.scales)
        self.zeros = pack_group_params(weight.zeros)
        self.scale_code = dtype_code(self.scales.dtype)
        self.bias = None if bias is None else bias.detach().float().contiguous()

    def __call__(self, x: Tensor, out: Tensor | None = None) -> Tensor:
        x = x.contiguous()
        rows = x.shape[0]
        y = x.new_empty(rows, self.out_features) if out is None else out
        bias = None if self.bias is None else self.bias.data_ptr()
        status = self.ops.pq_linear(
            self.bits, y.data_ptr(), self.out_features, x.data_ptr(), self.in_features, self.codes.data_ptr(),
            self.scales.data_ptr(), self.scale_code, self.zeros.data_ptr(), bias, rows, self.out_features,
            self.in_features, self.group, self.block, self.act_bits, torch.get_num_threads(),
        )  # fmt: skip
        if status != 0:
            raise RuntimeError(f"pq_linear failed ({status})")
        return y

    def gather_rows(self, ids: Tensor) -> Tensor:
        """Rows W[ids] dequantized to fp32 [len(ids), K]: the embedding lookup of a tied lm_head."""
        out = torch.empty(ids.shape[0], self.in_features)
        ids = ids.to(torch.int64).contiguous()
        self.ops.pq_gather_rows(
            self.bits, out.data_ptr(), self.codes.data_ptr(), self.scales.data_ptr(), self.scale_code,
            self.zeros.data_ptr(), ids.data_ptr(), ids.shape[0], self.in_features, self.group,
            torch.get_num_threads(),
        )  # fmt: skip
        return out

    @property
    def resident_bytes(self) -> int:
        parts = [self.codes, self.scales, self.zeros] + ([] if self.bias is None else [self.bias])
        return sum(t.numel() * t.element_size() for t in parts)
