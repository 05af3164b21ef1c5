"""The fast CPU forward's linear weights: one resident copy each, in the panel layout that
kernels/cpu_gemm.c reads for every batch size (its file comment draws the layout).

    W [N, K] (checkpoint dtype) ──pack_panels──▶ panels [N/64, K, 64] (fp32, fp16)
                                                  panels [N/64, K/2, 64, 2] (bf16: k pairs interleaved)

Packing happens once at load, layer by layer; the reference module's own tensor is then
dropped, so the weights are held once (checked by `resident_bytes` in tests and `make bench`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from kernels.cpu_build import DTYPES, CpuOps

PANEL = 64  # output columns per panel (cpu_gemm.c NR)
PANEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def dtype_code(dtype: torch.dtype) -> int:
    return DTYPES[str(dtype).removeprefix("torch.")]


def padded_k(k: int, dtype: torch.dtype) -> int:
    """bf16 panels interleave pairs of k, so an odd K gets one zero column."""
    return k + (k % 2) if dtype == torch.bfloat16 else k


def pack_panels(weight: Tensor, dtype: torch.dtype) -> tuple[Tensor, int]:
    """(panels, padded K) of a [N, K] weight, cast to `dtype` (exact when it is the checkpoint's
    dtype). Padding rows/columns are zeros, so they add nothing to any output."""
    n, k = weight.shape
    n_pad, k_pad = -(-n // PANEL) * PANEL, padded_k(k, dtype)
    if (n_pad, k_pad) == (n, k) and weight.dtype == dtype:
        padded = weight
    else:
        padded = torch.zeros(n_pad, k_pad, dtype=dtype)
        padded[:n, :k] = weight
    if dtype == torch.bfloat16:
        panels = padded.view(n_pad // PANEL, PANEL, k_pad // 2, 2).permute(0, 2, 1, 3).contiguous()
    else:
        panels = padded.view(n_pad // PANEL, PANEL, k_pad).permute(0, 2, 1).contiguous()
    return panels, k_pad


def unpack_panels(panels: Tensor, n: int, k: int) -> Tensor:
    """The [N, K] weight back from its panels (tests, and a tied embedding's rows)."""
    if panels.dim() == 4:  # bf16 pairs
        blocks, pairs = panels.shape[0], panels.shape[1]
        full = panels.permute(0, 2, 1, 3).reshape(blocks * PANEL, pairs * 2)
    else:
        full = panels.permute(0, 2, 1).reshape(panels.shape[0] * PANEL, panels.shape[1])
    return full[:n, :k]


class PanelLinear:
    """y = x W^T + b for fp32 x [M, K] -> fp32 y [M, N], any M, from W's one panel copy."""

    def __init__(self, ops: CpuOps, weight: Tensor, bias: Tensor | None, dtype: torch.dtype) -> None:
        self.ops = ops
        self.out_features, self.in_features = weight.shape
        self.dtype = dtype
        self.panels, self.k_pad = pack_panels(weight.detach(), dtype)
        self.code = dtype_code(dtype)
        self.bias = None if bias is None else bias.detach().float().contiguous()

    def __call__(self, x: Tensor, out: Tensor | None = None) -> Tensor:
        """y = x W^T + b, fp32 [rows, out_features]; `out`: a contiguous buffer of that shape to
        write instead of a new tensor."""
        x, bias = self._operands(x)
        rows = x.shape[0]
        y = x.new_empty(rows, self.out_features) if out is None else out
        status = self.ops.pk_linear(
            self.code, y.data_ptr(), self.out_features, x.data_ptr(), self.k_pad, self.panels.data_ptr(),
            bias, rows, self.out_features, self.k_pad, self.k_pad, torch.get_num_threads(),
        )  # fmt: skip
        if status != 0:
            raise MemoryError(f"pk_linear failed ({status}): no memory for its scratch rows")
        return y

    def argmax(self, x: Tensor) -> Tensor:
        """torch.argmax(self(x), dim=-1) (int64 [rows]) from the same values bit for bit, without
        writing them: a greedy LM head's [rows, vocab] logits, which nothing else reads."""
        x, bias = self._operands(x)
        ids = torch.empty(x.shape[0], dtype=torch.int64)
        status = self.ops.pk_linear_argmax(
            self.code, ids.data_ptr(), x.data_ptr(), self.k_pad, self.panels.data_ptr(), bias,
            x.shape[0], self.out_features, self.k_pad, self.k_pad, torch.get_num_threads(),
        )  # fmt: skip
        if status != 0:
            raise MemoryError(f"pk_linear_argmax failed ({status}): no memory for its scratch")
        return ids

    def _operands(self, x: Tensor) -> tuple[Tensor, int | None]:
        """x as the kernels read it (contiguous; odd K in bf16 gets the panels' zero column too)
        and the bias pointer (None: no bias)."""
        if self.k_pad != self.in_features:
            x = torch.nn.functional.pad(x, (0, self.k_pad - self.in_features))
        return x.contiguous(), None if self.bias is None else self.bias.data_ptr()

    def gather_rows(self, ids: Tensor) -> Tensor:
        """Rows W[ids] as fp32 [len(ids), K]: the embedding lookup of a tied lm_head."""
        out = torch.empty(ids.shape[0], self.in_features)
        ids = ids.to(torch.int64).contiguous()
        panels, threads = self.panels.data_ptr(), torch.get_num_threads()
        count, k = ids.shape[0], self.in_features
        self.ops.pk_gather_rows(
            self.code, out.data_ptr(), panels, ids.data_ptr(), count, k, self.k_pad, threads
        )
        return out

    @property
    def resident_bytes(self) -> int:
        extra = 0 if self.bias is None else self.bias.numel() * 4
        return self.panels.numel() * self.panels.element_size() + extra


def fused(ops: CpuOps, linears: list[torch.nn.Linear], dtype: torch.dtype) -> PanelLinear:
    """One PanelLinear for projections of the same input (q|k|v, gate|up)."""
    weight = torch.cat([lin.weight.detach() for lin in linears])
    biases = [lin.bias for lin in linears]
    bias = torch.cat([b.detach() for b in biases]) if biases[0] is not None else None
    return PanelLinear(ops, weight, bias, dtype)


def release(*modules: torch.nn.Module) -> None:
    """Drop the reference modules' parameters once packed: the panels are the one copy."""
    for module in modules:
        for name, param in list(module.named_parameters(recurse=False)):
            setattr(module, name, torch.nn.Parameter(param.new_empty(0), requires_grad=False))
