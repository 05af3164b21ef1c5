"""Quantized KV cache (issue 31): the formats, their scales, and the torch oracle of the C kernels.

A quantized pool holds 8-bit codes (fp8 e4m3, fp8 e5m2 or int8) in a uint8 tensor shaped like
the unquantized pool, plus one scale byte per (slot, kv head) in a pool of its own shaped
[num_blocks, block_size, num_kv_heads]: block id first, like the codes, so copy-on-write, block
copies and preemption (which are all block copies or block reuse) carry the scales with their
block and nothing else has to know they exist.

    byte = e << 3 | m:  scale = 2^(e - 20) * (1 + m / 8)        value = code * scale * tensor_scale

The byte is an unsigned float of 5 exponent and 3 mantissa bits (scales 2^-20 .. 3840).
Dynamic (default): per (token, kv head), amax / qmax rounded up to the byte, computed when the
token is stored; tensor_scale = 1. From the checkpoint (fp8_e4m3 only: what compressed-tensors
and ModelOpt calibrate k_scale / v_scale for): every byte means 1.0 (SCALE_ONE) and tensor_scale
is the layer's k_scale or v_scale. Why per token and head: a token's scale never changes after
it is written (a per-block scale would have to grow, and requantize the block, as later tokens
arrive; measured no more accurate either), outlier heads do not cost the others precision, and
one byte per head_dim codes keeps the pool at 2x the blocks of bf16 (1.97x at head_dim 64).
Why 3 mantissa bits: measured against a power of two (an E8M0 byte, which leaves int8 6-7 bits)
and an exact fp32 scale (4 bytes, 1.88x the blocks of bf16: below the 1.95x goal): the byte is
within 0-1 point of fp32's agreement, the power of two up to a point below the byte
(bench/kv_scale_study.py; PERF.md "KV cache scale format").

`quantize` / `dequantize` here are bit-identical to kernels/cpu_kv_quant.h's store (same byte,
same round-to-nearest-even codes) and to the CUDA one (kernels/kv_quant.cuh): the reference
forward and the tests use them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from kernels.cpu_build import KV_CODE_DTYPES
from worker.errors import ModelLoadError, WorkerConfigError

SCALE_BIAS = 20  # scale byte e << 3 | m means 2^(e - SCALE_BIAS) (1 + m / 8)
SCALE_ONE = SCALE_BIAS << 3  # the byte of 1.0 (per-tensor checkpoint scales)
_REBIAS = (127 - SCALE_BIAS) << 3  # byte + _REBIAS = an fp32's top 12 bits (sign 0)
KV_CACHE_DTYPES = ("auto", "fp8_e4m3", "fp8_e5m2", "int8")


@dataclass(frozen=True, slots=True)
class KVFormat:
    """One quantized code type; `code` is the kernels' DT_* value (kernels/cpu_build.py
    KV_CODE_DTYPES)."""

    name: str
    torch_dtype: torch.dtype  # what the uint8 codes are, viewed
    qmax: float
    code: int


FORMATS = {
    "fp8_e4m3": KVFormat("fp8_e4m3", torch.float8_e4m3fn, 448.0, KV_CODE_DTYPES["fp8_e4m3"]),
    "fp8_e5m2": KVFormat("fp8_e5m2", torch.float8_e5m2, 57344.0, KV_CODE_DTYPES["fp8_e5m2"]),
    "int8": KVFormat("int8", torch.int8, 127.0, KV_CODE_DTYPES["int8"]),
}


@dataclass(frozen=True, slots=True)
class KvQuantPools:
    """A layer's quantized-pool extras for a backend's kernels (CUDA): the format, the
    scale-byte pools [blocks, block_size, kv_heads] (uint8) and the per-tensor scales (0.0:
    computed per token and head)."""

    kv_cache_dtype: str  # "fp8_e4m3" | "fp8_e5m2" | "int8"
    k_bytes: Tensor
    v_bytes: Tensor
    k_tensor_scale: float = 0.0
    v_tensor_scale: float = 0.0

    def launch_values(self) -> tuple:
        """The kernels' trailing (k scales, v scales, k tensor scale, v tensor scale)."""
        return (
            self.k_bytes.data_ptr(),
            self.v_bytes.data_ptr(),
            self.k_tensor_scale or 1.0,
            self.v_tensor_scale or 1.0,
        )


def kv_format(name: str | None) -> KVFormat | None:
    """The format of a `--kv-cache-dtype` value; None for "auto" (the model's dtype)."""
    if name in (None, "auto"):
        return None
    if name not in FORMATS:
        raise WorkerConfigError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {name!r}")
    return FORMATS[name]


def scale_of(byte: Tensor) -> Tensor:
    """The fp32 scale of each byte: exact (the byte is an fp32's top bits, re-biased)."""
    return ((byte.to(torch.int32) + _REBIAS) << 20).view(torch.float32)


def scale_bytes(amax: Tensor, fmt: KVFormat) -> Tensor:
    """The smallest byte whose scale is >= amax / qmax (the fp32 quotient, rounded up to 3
    mantissa bits), clamped to 0..255; 0 where amax is 0 or NaN."""
    amax = amax.float()
    quotient = amax / torch.full_like(amax, fmt.qmax)  # elementwise IEEE division, as the kernels
    bits = (quotient.view(torch.int32) + 0xFFFFF) & ~0xFFFFF
    byte = ((bits >> 20) - _REBIAS).clamp(0, 255)
    return torch.where(amax > 0, byte, torch.zeros_like(byte)).to(torch.uint8)


def quantize(x: Tensor, fmt: KVFormat, tensor_scale: float = 0.0) -> tuple[Tensor, Tensor]:
    """x [..., head_dim] -> (uint8 codes [..., head_dim], scale bytes [...]). tensor_scale 0:
    a computed byte per row, x / its scale; else the checkpoint's per-tensor scale, x times its
    inverse, and bytes of SCALE_ONE."""
    x = x.float()
    if tensor_scale == 0.0:
        byte = scale_bytes(x.abs().amax(-1), fmt)
        y = x / scale_of(byte)[..., None].expand_as(x).contiguous()
    else:
        byte = torch.full(x.shape[:-1], SCALE_ONE, dtype=torch.uint8)
        inverse = torch.tensor(1.0, dtype=torch.float32) / torch.tensor(tensor_scale, dtype=torch.float32)
        y = x * inverse
    y = y.clamp(-fmt.qmax, fmt.qmax)
    codes = torch.round(y).to(torch.int8) if fmt.torch_dtype == torch.int8 else y.to(fmt.torch_dtype)
    return codes.view(torch.uint8), byte


def dequantize(codes: Tensor, byte: Tensor, fmt: KVFormat, tensor_scale: float = 0.0) -> Tensor:
    """The fp32 values of codes [..., head_dim] with their scale bytes [...]."""
    values = codes.view(fmt.torch_dtype).float() * scale_of(byte)[..., None]
    return values * tensor_scale if tensor_scale != 0.0 else values


# -- checkpoint scales ------------------------------------------------------------------------
_SCALE_NAMES = ("model.layers.{i}.self_attn.{kv}_scale", "model.layers.{i}.self_attn.{kv}_proj.{kv}_scale")


def load_checkpoint_scales(model_dir: str | Path, num_layers: int) -> tuple[list[float], list[float]] | None:
    """Per-layer (k_scales, v_scales) from a checkpoint that ships them (compressed-tensors writes
    `self_attn.k_scale`, ModelOpt `self_attn.k_proj.k_scale`), or None when it ships none.
    A scale that is not one positive finite number, or a checkpoint with some layers' scales
    and not others, is refused by name (ModelLoadError)."""
    from safetensors import safe_open

    from worker.weights import locate_tensors

    if Path(model_dir).suffix.lower() == ".gguf":  # llama.cpp's format stores no KV scales
        return None
    located = locate_tensors(model_dir)
    found: dict[tuple[str, int], str] = {}
    for i in range(num_layers):
        for kv in ("k", "v"):
            for pattern in _SCALE_NAMES:
                name = pattern.format(i=i, kv=kv)
                if name in located:
                    found[(kv, i)] = name
    if not found:
        return None
    missing = [f"layer {i} {kv}_scale" for i in range(num_layers) for kv in "kv" if (kv, i) not in found]
    if missing:
        raise ModelLoadError(
            f"the checkpoint ships KV scales for some layers only: missing {', '.join(missing[:8])}"
        )
    scales = {"k": [0.0] * num_layers, "v": [0.0] * num_layers}
    for (kv, i), name in found.items():
        with safe_open(str(located[name]), framework="pt") as f:
            tensor = f.get_tensor(name)
        if tensor.numel() != 1 or tensor.dim() > 1:
            raise ModelLoadError(
                f"KV scale tensor {name} has shape {tuple(tensor.shape)}: a per-tensor scale is one "
                "number (shape () or (1,)); per-head or per-channel KV scales are not supported"
            )
        value = float(tensor.float().reshape(()))
        if not (value > 0.0 and value != float("inf")):
            raise ModelLoadError(f"KV scale tensor {name} is {value}: a scale must be positive and finite")
        scales[kv][i] = value
    return scales["k"], scales["v"]


def resolve_kv_quant(
    name: str, device: torch.device, model_dir: str | Path, num_layers: int
) -> tuple[KVFormat | None, tuple[list[float], list[float]] | None]:
    """The worker's quantized-KV setup: (format, per-layer checkpoint scales or None). Refuses
    at start, with the reason, what this worker cannot serve: a quantized cache on a backend
    with no kernels for one (anything but CPU and CUDA), or a
    checkpoint's scale tensors of the wrong shape (by name, for any quantized format). The
    checkpoint's scales are used for fp8_e4m3, the format they are calibrated for; int8 and
    fp8_e5m2 compute their scales per token and head."""
    fmt = kv_format(name)
    if fmt is None:
        return None, None
    if device.type not in ("cpu", "cuda"):
        raise WorkerConfigError(
            f"--kv-cache-dtype {name}: the {device.type} backend has no kernels for a quantized KV cache; "
            "they exist for the CPU and CUDA workers (use --kv-cache-dtype auto here)"
        )
    scales = load_checkpoint_scales(model_dir, num_layers)
    return fmt, scales if fmt.name == "fp8_e4m3" else None


def describe_scales(fmt: KVFormat | None, scales: tuple[list[float], list[float]] | None) -> str:
    """ModelFacts.kv_cache_scales."""
    if fmt is None:
        return ""
    if scales is not None:
        return "per tensor (checkpoint k_scale/v_scale)"
    return "per token and kv head (e5m3 byte, computed)"
