"""Checkpoint formats -> QuantizedWeight, one decoder per format. Each knows the tensor names and
shapes of one linear layer ("<prefix>.qweight", ...) and turns them into codes / scales / zeros
(worker/quant/weight.py). Shapes and dtypes are checked against the layer's (out, in) features
before anything is unpacked; a mismatch is a ModelLoadError naming the tensor and what was
expected.

    AutoAWQ GEMM   qweight int32 [K, N/8]  qzeros int32 [K/g, N/8]  scales fp16 [K/g, N]
                   8 codes per int32 along N in AWQ's interleaved order: nibble i holds column
                   8j + (0, 2, 4, 6, 1, 3, 5, 7)[i]
    GPTQ           qweight int32 [K*b/32, N] (codes along K, low bits first)
                   qzeros int32 [K/g, N*b/32] (along N) + 1 in the v1 format ("gptq")
                   scales fp16 [K/g, N]; g_idx int32 [K], which must be k // g (no act-order)
    compressed-    pack-quantized: weight_packed int32 [N, K*b/32] (along K, low bits first),
    tensors        codes = signed value + 2^(b-1); weight_scale [N, G]; weight_zero_point
                   int32 [N*b/32, G] (packed along N) when asymmetric; weight_shape [2]
                   int-quantized (W8A8): weight int8 [N, K], weight_scale [N, 1]
"""

from __future__ import annotations

import torch
from torch import Tensor

from worker.errors import ModelLoadError
from worker.quant.scheme import QuantScheme
from worker.quant.weight import QuantizedWeight

AWQ_COLUMN_OF_NIBBLE = (0, 2, 4, 6, 1, 3, 5, 7)
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _groups(scheme: QuantScheme, k: int, prefix: str) -> tuple[int, int]:
    """(group size, number of groups) of a layer with k input features."""
    group = scheme.group_size or k
    if k % group:
        raise ModelLoadError(f"{prefix}: group_size {group} does not divide the {k} input features")
    return group, k // group


def expected_tensors(
    scheme: QuantScheme, prefix: str, n: int, k: int
) -> dict[str, tuple[tuple[int, ...], tuple]]:
    """name -> (shape, allowed dtypes) of the tensors that hold one quantized linear layer."""
    b = scheme.bits
    group, g = _groups(scheme, k, prefix)
    if scheme.method == "awq":
        if n % 8:
            raise ModelLoadError(
                f"{prefix}: AWQ packs 8 output features per int32; {n} is not a multiple of 8"
            )
        out = {f"{prefix}.qweight": ((k, n // 8), (torch.int32,)), f"{prefix}.scales": ((g, n), FLOAT_DTYPES)}
        if not scheme.symmetric:
            out[f"{prefix}.qzeros"] = ((g, n // 8), (torch.int32,))
        return out
    per = 32 // b
    if scheme.method == "gptq":
        if k % per or n % per:
            raise ModelLoadError(f"{prefix}: GPTQ packs {per} values per int32; ({n}, {k}) is not a multiple")
        return {
            f"{prefix}.qweight": ((k // per, n), (torch.int32,)),
            f"{prefix}.qzeros": ((g, n // per), (torch.int32,)),
            f"{prefix}.scales": ((g, n), FLOAT_DTYPES),
        }
    if scheme.format == "int-quantized":
        return {f"{prefix}.weight": ((n, k), (torch.int8,)), f"{prefix}.weight_scale": ((n, 1), FLOAT_DTYPES)}
    out = {
        f"{prefix}.weight_packed": ((n, -(-k * b // 32)), (torch.int32,)),
        f"{prefix}.weight_scale": ((n, g), FLOAT_DTYPES),
        f"{prefix}.weight_shape": ((2,), (torch.int32, torch.int64)),
    }
    if not scheme.symmetric:
        out[f"{prefix}.weight_zero_point"] = ((-(-n * b // 32), g), (torch.int32,))
    return out


def optional_tensors(scheme: QuantScheme, prefix: str) -> tuple[str, ...]:
    """Tensors a format may or may not write (checked when present)."""
    return (f"{prefix}.g_idx",) if scheme.method == "gptq" else ()


def _unpack(packed: Tensor, bits: int, dim: int) -> Tensor:
    """int32 words -> uint8 codes, low bits first, along `dim` (the packed dimension grows)."""
    per, mask = 32 // bits, (1 << bits) - 1
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    words = packed.to(torch.int32)
    if dim == 0:
        codes = (words[:, None, :] >> shifts[None, :, None]) & mask  # [rows, per, cols]
        return codes.reshape(words.shape[0] * per, words.shape[1]).to(torch.uint8)
    codes = (words[:, :, None] >> shifts[None, None, :]) & mask  # [rows, cols, per]
    return codes.reshape(words.shape[0], words.shape[1] * per).to(torch.uint8)


def decode(scheme: QuantScheme, prefix: str, tensors: dict[str, Tensor], n: int, k: int) -> QuantizedWeight:
    """The layer's QuantizedWeight from its (already shape-checked) tensors."""
    b = scheme.bits
    group, _ = _groups(scheme, k, prefix)
    middle = 1 << (b - 1)
    if scheme.method == "awq":
        order = torch.tensor([AWQ_COLUMN_OF_NIBBLE.index(c) for c in range(8)])  # nibble of column c
        codes_t = _unpack(tensors[f"{prefix}.qweight"], 4, 1).view(k, n // 8, 8)[:, :, order].reshape(k, n)
        scales = tensors[f"{prefix}.scales"].t().contiguous()
        if scheme.symmetric:
            zeros = torch.full_like(scales, middle, dtype=torch.uint8)
        else:
            zeros_t = (
                _unpack(tensors[f"{prefix}.qzeros"], 4, 1).view(-1, n // 8, 8)[:, :, order].reshape(-1, n)
            )
            zeros = zeros_t.t().contiguous()
        return QuantizedWeight(codes_t.t().contiguous(), scales, zeros, b, group)
    if scheme.method == "gptq":
        g_idx = tensors.get(f"{prefix}.g_idx")
        if g_idx is not None and not torch.equal(g_idx.to(torch.int64), torch.arange(k) // group):
            raise ModelLoadError(
                f"{prefix}.g_idx is not k // group_size: act-order (desc_act) checkpoints whose groups are "
                "permuted are not supported; requantize with desc_act=false"
            )
        codes = _unpack(tensors[f"{prefix}.qweight"], b, 0).t().contiguous()
        zeros = _unpack(tensors[f"{prefix}.qzeros"], b, 1).t().contiguous()
        if scheme.format == "gptq":  # v1 stores zero - 1 (AutoGPTQ): the real zero may reach 2^bits
            zeros = zeros + 1
        return QuantizedWeight(codes, tensors[f"{prefix}.scales"].t().contiguous(), zeros, b, group)
    if scheme.format == "int-quantized":
        codes = (tensors[f"{prefix}.weight"].to(torch.int16) + 128).to(torch.uint8)
        scales = tensors[f"{prefix}.weight_scale"]
        zeros = torch.full_like(scales, 128, dtype=torch.uint8)
        act_bits = 8 if scheme.activations == "int8-token" else 16
        return QuantizedWeight(codes, scales.contiguous(), zeros, 8, k, act_bits)
    shape = tuple(int(v) for v in tensors[f"{prefix}.weight_shape"])
    if shape != (n, k):
        raise ModelLoadError(f"{prefix}.weight_shape is {shape}, but config.json implies {(n, k)}")
    codes = _unpack(tensors[f"{prefix}.weight_packed"], b, 1)[:, :k].contiguous()
    scales = tensors[f"{prefix}.weight_scale"].contiguous()
    if scheme.symmetric:
        zeros = torch.full_like(scales, middle, dtype=torch.uint8)
    else:  # packed along N, signed + 2^(b-1) like the codes
        zeros = _unpack(tensors[f"{prefix}.weight_zero_point"], b, 0)[:n].contiguous()
    return QuantizedWeight(codes, scales, zeros, b, group)
