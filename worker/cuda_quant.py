"""Quantized linear layers on CUDA: a QuantizedWeight (worker/quant/weight.py) packed once, on the
device, into the layout kernels/quant_linear.cu reads, and served from its codes.

    qweight  int32 [N, K / P]   P = 32 / bits codes per word, along K, low bits first
    qparams  int32 [N, G]       16-bit scales: scale bits | zero << 16
             int32 [N, G, 2]    fp32 scales: (scale bits, zero)

`CudaQuantLinear.forward` runs the GEMV kernel for up to 8 rows (decode: the codes are read
once, 4x fewer bytes than an fp16 weight at 4 bits) and, for more rows (prefill, large decode
batches), the dequantize kernel into one scratch buffer shared by every layer (sized for the
largest) followed by cuBLAS. The scratch can be shared because layers run one after another on
one stream; it is allocated once, so CUDA-graph capture sees no new workspace.

`replace_quantized_linears` swaps every quantized nn.Linear of a CausalLM for one of these (the
worker's CUDA start-up). Without a CUDA backend (tests on the CPU) the modules compute with
`dequantize_packed`, a torch transcription of the dequantize kernel that reads the same packed
tensors, so the packing and the module swap are checked without a GPU.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from base.logs import get_logger
from kernels.launch import (
    QUANT_DEQUANT_PARAMS,
    QUANT_GEMV_PARAMS,
    gemv_rows_bucket,
    named_args,
    quant_dequant_launch,
    quant_gemv_launch,
    quant_shape_problem,
)
from kernels.specs import GEMV_ROW_BUCKETS, QuantLinearSpec, codes_per_word, quant_linear_program
from worker.quant.activations import round_inputs_to_int8_tokens
from worker.quant.weight import QuantizedWeight

log = get_logger("pagedkv.worker.cuda_quant")

_ALIGN = 16  # bytes: the GEMV reads x rows with 16-byte vectors


def _to_int32(words: Tensor) -> Tensor:
    """uint32 bit patterns held in int64 -> int32 with the same bits (no overflowing shifts)."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def pack_codes(codes: Tensor, bits: int) -> Tensor:
    """uint8 codes [N, K] -> int32 [N, K / P]: code k of column n in word k // P, bits
    (k % P) * bits upward. Built in int64, one code position at a time (N * K / P words of
    temporary memory, not one int64 per code)."""
    n, k = codes.shape
    per = codes_per_word(bits)
    if k % per:
        raise ValueError(f"K = {k} is not a multiple of {per} codes per word")
    words = torch.zeros(n, k // per, dtype=torch.int64, device=codes.device)
    for i in range(per):
        words |= codes[:, i::per].to(torch.int64) << (i * bits)
    return _to_int32(words)


def pack_group_params(scales: Tensor, zeros: Tensor) -> Tensor:
    """Scales [N, G] (fp16/bf16/fp32, bits kept) and uint8 zeros [N, G] -> one entry per group."""
    zeros = zeros.to(torch.int32)
    if scales.dtype == torch.float32:
        return torch.stack([scales.view(torch.int32), zeros], dim=-1).contiguous()
    if scales.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"unsupported scale dtype {scales.dtype}")
    return (scales.contiguous().view(torch.int16).to(torch.int32) & 0xFFFF) | (zeros << 16)


def unpack_group_params(qparams: Tensor, scale_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """The inverse of pack_group_params: (fp32 scales, int64 zeros), each [N, G]."""
    if scale_dtype == torch.float32:
        return qparams[..., 0].contiguous().view(torch.float32), qparams[..., 1].to(torch.int64)
    low = qparams & 0xFFFF
    low = torch.where(low >= 2**15, low - 2**16, low).to(torch.int16)  # the same 16 bits, signed
    return low.view(scale_dtype).float(), (qparams.to(torch.int64) >> 16) & 0xFFFF


def dequantize_packed(
    qweight: Tensor, qparams: Tensor, bits: int, group_size: int, scale_dtype: torch.dtype, dtype: torch.dtype
) -> Tensor:
    """What quant_dequant_kernel writes: T((c - z) * s) per element, from the packed tensors."""
    n, words = qweight.shape
    per, mask = codes_per_word(bits), (1 << bits) - 1
    shifts = torch.arange(per, device=qweight.device, dtype=torch.int64) * bits
    codes = ((qweight.to(torch.int64)[:, :, None] >> shifts) & mask).reshape(n, words * per)
    scale, zero = unpack_group_params(qparams, scale_dtype)
    group = torch.arange(words * per, device=qweight.device) // group_size
    return ((codes - zero[:, group]).float() * scale[:, group]).to(dtype)


class QuantKernels:
    """The loaded kernels of one QuantLinearSpec, on a CudaAttentionBackend's device."""

    def __init__(self, backend, spec: QuantLinearSpec) -> None:
        loaded = backend.driver.load(quant_linear_program(spec), backend.cache)
        self.spec = spec
        self.driver = backend.driver
        self.device = backend.device
        self.gemv = {rows: loaded[spec.gemv_expression(rows)] for rows in GEMV_ROW_BUCKETS}
        self.dequant = loaded[spec.dequant_expression]

    def stream(self) -> int:
        """torch's current stream (the graph's, while capturing), in the driver's context."""
        self.driver.make_current()
        return torch.cuda.current_stream(self.device).cuda_stream


class DequantScratch:
    """One dense weight buffer for the dequantize + cuBLAS path, shared by every layer."""

    def __init__(self, elements: int, dtype: torch.dtype, device: torch.device) -> None:
        self.buffer = torch.empty(elements, dtype=dtype, device=device)

    def weight(self, n: int, k: int) -> Tensor:
        return self.buffer[: n * k].view(n, k)


def _aligned_rows(x: Tensor) -> Tensor:
    """x [M, K] as the GEMV reads it (unit stride, base and row stride 16-byte aligned), or a copy."""
    size = x.element_size()
    if x.stride(-1) == 1 and x.data_ptr() % _ALIGN == 0 and (x.stride(0) * size) % _ALIGN == 0:
        return x
    return x.contiguous() if not x.is_contiguous() else x.clone()


class CudaQuantLinear(nn.Module):
    """y = x W^T + b with W held as packed codes (see the module docstring)."""

    def __init__(
        self,
        weight: QuantizedWeight,
        bias: Tensor | None,
        dtype: torch.dtype,
        device: torch.device | str,
        kernels: QuantKernels | None = None,
        scratch: DequantScratch | None = None,
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        problem = quant_shape_problem(self.out_features, self.in_features, weight.group_size)
        if problem is not None:
            raise ValueError(f"the CUDA quantized-linear kernels cannot take this layer: {problem}")
        self.bits, self.group_size, self.dtype = weight.bits, weight.group_size, dtype
        self.scale_dtype = weight.scales.dtype
        self.register_buffer("qweight", pack_codes(weight.codes.to(device), weight.bits), persistent=False)
        params = pack_group_params(weight.scales.to(device), weight.zeros.to(device))
        self.register_buffer("qparams", params, persistent=False)
        self.bias = None if bias is None else bias.detach().to(device=device, dtype=dtype).contiguous()
        self.kernels, self.scratch = kernels, scratch
        if kernels is not None and scratch is None:
            raise ValueError("the CUDA path needs a DequantScratch for rows above the GEMV's")

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}, "
            f"group_size={self.group_size}, scales={self.scale_dtype}, bias={self.bias is not None}"
        )

    def forward(self, x: Tensor) -> Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features).to(self.dtype)
        rows = x2.shape[0]
        if self.kernels is None:  # no CUDA backend: the torch transcription (tests)
            y = F.linear(x2, self.dequantize_reference(), self.bias)
        elif rows == 0:
            y = x2.new_empty(0, self.out_features)
        elif gemv_rows_bucket(rows) is None:
            weight = self.scratch.weight(self.out_features, self.in_features)
            self.dequantize_into(weight)
            y = F.linear(x2, weight, self.bias)
        else:
            y = x2.new_empty(rows, self.out_features)
            self.gemv_into(y, x2)
        return y.reshape(*lead, self.out_features)

    def gemv_into(self, y: Tensor, x: Tensor) -> None:
        """y [rows, N] (contiguous) = x [rows, K] W^T + b through quant_gemv_kernel, rows <= 8."""
        rows = x.shape[0]
        bucket = gemv_rows_bucket(rows)
        if bucket is None or not y.is_contiguous() or y.shape != (rows, self.out_features):
            raise ValueError(f"GEMV: y {tuple(y.shape)} for x {tuple(x.shape)} (at most 8 contiguous rows)")
        if x.dtype != self.dtype or y.dtype != self.dtype:
            raise ValueError(f"GEMV: x and y must be {self.dtype}, got {x.dtype} and {y.dtype}")
        x = _aligned_rows(x)
        args = named_args(
            QUANT_GEMV_PARAMS,
            y=y.data_ptr(),
            x=x.data_ptr(),
            x_stride=x.stride(0),
            qweight=self.qweight.data_ptr(),
            qparams=self.qparams.data_ptr(),
            bias=0 if self.bias is None else self.bias.data_ptr(),
            rows=rows,
            n=self.out_features,
            k=self.in_features,
            group_size=self.group_size,
        )
        self.kernels.gemv[bucket].launch(quant_gemv_launch(self.out_features), args, self.kernels.stream())

    def dequantize_into(self, out: Tensor) -> None:
        """The dense weight [N, K] into `out` (contiguous, self.dtype) through quant_dequant_kernel."""
        n, k = self.out_features, self.in_features
        if (
            out.shape != (n, k)
            or not out.is_contiguous()
            or out.dtype != self.dtype
            or out.data_ptr() % _ALIGN
        ):
            raise ValueError(f"dequantize: out must be a contiguous, 16-byte aligned {self.dtype} [{n}, {k}]")
        args = named_args(
            QUANT_DEQUANT_PARAMS,
            out=out.data_ptr(),
            qweight=self.qweight.data_ptr(),
            qparams=self.qparams.data_ptr(),
            n=n,
            k=k,
            group_size=self.group_size,
        )
        self.kernels.dequant.launch(quant_dequant_launch(n, k, self.bits), args, self.kernels.stream())

    def dequantize_reference(self) -> Tensor:
        return dequantize_packed(
            self.qweight, self.qparams, self.bits, self.group_size, self.scale_dtype, self.dtype
        )


def replace_quantized_linears(model: nn.Module, dtype: torch.dtype, backend=None) -> int:
    """Swap each layer of `model.quantized` (module name -> QuantizedWeight: a CausalLM's, see
    worker/model.py) for a CudaQuantLinear on `backend`'s device, then empty `model.quantized`.
    A layer the kernels cannot take (K or group not a multiple of 8: no real checkpoint) is
    dequantized into its nn.Linear instead, with a warning. `backend` None: CPU modules that
    compute through dequantize_packed (tests). Returns how many layers hold packed codes."""
    device = backend.device if backend is not None else torch.device("cpu")
    modules = dict(model.named_modules())
    packed = {}
    for name, weight in model.quantized.items():
        problem = quant_shape_problem(*weight.shape, weight.group_size)
        if problem is None:
            packed[name] = weight
            continue
        log.warning("worker.quantized_layer_dense", layer=name, reason=problem)
        modules[name].weight = nn.Parameter(weight.dequantize(dtype).to(device), requires_grad=False)
        if weight.act_bits == 8:
            round_inputs_to_int8_tokens(modules[name])
    scratch = None
    if backend is not None and packed:
        scratch = DequantScratch(max(w.shape[0] * w.shape[1] for w in packed.values()), dtype, device)
    kernels: dict[QuantLinearSpec, QuantKernels] = {}
    for name, weight in packed.items():
        spec = QuantLinearSpec(_dtype_name(dtype), _dtype_name(weight.scales.dtype), weight.bits)
        if backend is not None and spec not in kernels:
            kernels[spec] = QuantKernels(backend, spec)
        parent_name, _, attr = name.rpartition(".")
        old = modules[name]
        linear = CudaQuantLinear(weight, old.bias, dtype, device, kernels.get(spec), scratch)
        if weight.act_bits == 8:  # W8A8: the format's int8 inputs, rounded before the A16 kernels
            round_inputs_to_int8_tokens(linear)
        # A tensor-parallel row-parallel layer (worker/tp/sharded_model.py) all-reduces its
        # linear's partial output: it stays around the kernels' module, or the sum is lost.
        around = getattr(old, "around", None)
        parent = modules[parent_name] if parent_name else model
        setattr(parent, attr, linear if around is None else around(linear))
    model.quantized = {}
    return len(packed)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
