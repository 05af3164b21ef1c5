"""ctypes mirrors of kernels/cpu_decoder.c's structures, and the call that runs one step of the
decoder stack in C. The model structure (every layer's panels, norms and K/V pools) is built
once per KV cache; a step fills only PkStep. Field order and types must equal the C structs
(tests/kernels/test_cpu_decoder.py compares them with the C source)."""

from __future__ import annotations

import ctypes

import torch
from torch import Tensor

from kernels.cpu_build import CpuOps
from worker.cpu_gguf_linear import PK_KIND_GGUF, GgufLinear
from worker.cpu_quant_weights import QuantLinear
from worker.cpu_weights import dtype_code

_P, _I64, _I32, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32, ctypes.c_float


class PkLinear(ctypes.Structure):
    _fields_ = [
        ("kind", _I32), ("scale_dtype", _I32), ("w", _P), ("scales", _P), ("zeros", _P), ("bias", _P),
        ("n", _I64), ("k", _I64), ("kp", _I64), ("group", _I64), ("block", _I64), ("act_bits", _I64),
    ]  # fmt: skip


class PkLayer(ctypes.Structure):
    _fields_ = [
        ("qkv", PkLinear), ("o", PkLinear), ("gate_up", PkLinear), ("down", PkLinear),
        ("input_norm", _P), ("post_norm", _P), ("q_norm", _P), ("k_norm", _P),
        ("k_cache", _P), ("v_cache", _P),
        ("k_exps", _P), ("v_exps", _P), ("k_scale", _F32), ("v_scale", _F32),
        ("window", _I64),
    ]  # fmt: skip


class PkModel(ctypes.Structure):
    _fields_ = [
        ("num_layers", _I64), ("hidden", _I64), ("heads", _I64), ("kv_heads", _I64), ("head_dim", _I64),
        ("inter", _I64), ("kv_dtype", _I32), ("eps", _F32), ("scale", _F32),
        ("layers", ctypes.POINTER(PkLayer)), ("final_norm", _P),
    ]  # fmt: skip


class PkStep(ctypes.Structure):
    _fields_ = [
        ("tokens", _I64), ("cos", _P), ("sin", _P), ("slots", _P), ("block_tables", _P),
        ("table_width", _I64), ("table_rows", _P), ("seq_lens", _P), ("query_start_loc", _P),
        ("num_seqs", _I64), ("block_size", _I64), ("sample_rows", _P), ("num_sample_rows", _I64),
        ("lora", _P),
    ]  # fmt: skip


def _ptr(t: Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _linear(lin) -> PkLinear:
    """A PanelLinear, QuantLinear or GgufLinear as the C struct."""
    n, k, bias = lin.out_features, lin.in_features, _ptr(lin.bias)
    if isinstance(lin, GgufLinear):
        return PkLinear(PK_KIND_GGUF, 0, lin.parts_ptr, None, None, bias, n, k, k, len(lin.types), 0, 0)
    if isinstance(lin, QuantLinear):
        tensors = (lin.codes.data_ptr(), lin.scales.data_ptr(), lin.zeros.data_ptr())
        return PkLinear(lin.bits, lin.scale_code, *tensors, bias, n, k, k, lin.group, lin.block, lin.act_bits)
    return PkLinear(lin.code, 0, lin.panels.data_ptr(), None, None, bias, n, k, lin.k_pad, 0, 0, 0)


def kv_dtype_code(kv_cache) -> int:
    """The kernels' DT_* of the pools: a quantized format's code, else the pools' dtype's."""
    fmt = kv_cache.kv_format
    return fmt.code if fmt is not None else dtype_code(kv_cache.k_caches[0].dtype)


def _scale_pools(kv_cache, layer: int) -> tuple:
    """(k_exps, v_exps, k_scale, v_scale) of PkLayer: NULL and 0 for unquantized pools."""
    if kv_cache.kv_format is None:
        return None, None, 0.0, 0.0
    return (
        kv_cache.k_exps[layer].data_ptr(), kv_cache.v_exps[layer].data_ptr(),
        kv_cache.k_scales[layer], kv_cache.v_scales[layer],
    )  # fmt: skip


class DecoderStack:
    """The C view of a FastCpuForward's layers over one KV cache (the structs hold raw
    pointers: this object keeps every tensor they point into alive through `forward`)."""

    def __init__(self, forward, kv_cache) -> None:
        self.forward, self.kv_cache = forward, kv_cache
        self.layers = (PkLayer * len(forward.layers))()
        for i, layer in enumerate(forward.layers):
            linears = [_linear(lin) for lin in (layer.qkv, layer.o_proj, layer.gate_up, layer.down)]
            norms = [_ptr(t) for t in (layer.input_norm, layer.post_norm, layer.q_norm, layer.k_norm)]
            pools = [kv_cache.k_caches[i].data_ptr(), kv_cache.v_caches[i].data_ptr()]
            window = forward.windows[i] if forward.windows else 0
            self.layers[i] = PkLayer(*linears, *norms, *pools, *_scale_pools(kv_cache, i), window)
        self.model = PkModel(
            len(forward.layers), forward.hidden, forward.heads, forward.kv_heads, forward.head_dim,
            forward.layers[0].gate_up.out_features // 2, kv_dtype_code(kv_cache), forward.eps,
            forward.scale, self.layers, forward.final_norm.data_ptr(),
        )  # fmt: skip
        self._scratch = torch.empty(0)

    def scratch(self, ops: CpuOps, tokens: int) -> Tensor:
        """A scratch block for `tokens` tokens, grown (never shrunk) as steps need."""
        need = ops.pk_decoder_scratch_bytes(ctypes.byref(self.model), tokens) // 4
        if self._scratch.numel() < need:
            self._scratch = torch.empty(need)
        return self._scratch

    def run(self, ops: CpuOps, inputs, x: Tensor, threads: int, rows: Tensor, lora: int | None = None):
        """x [T, hidden] fp32 (embeddings; becomes the residual stream) -> the final-norm hidden
        states of `rows` (int64, ascending, distinct: the C side gathers them in place).
        `lora`: the address of a PkLora (worker/lora/cpu_apply.py) for per-row adapter deltas."""
        meta = inputs.attention
        rows = rows.contiguous()
        freqs = inputs.positions[:, None].to(torch.float32) * self.forward.inv_freq[None, :]
        cos, sin = freqs.cos(), freqs.sin()  # [T, head_dim / 2]
        out = torch.empty(rows.shape[0], self.forward.hidden)
        tables = meta.block_tables
        step = PkStep(
            inputs.num_tokens, cos.data_ptr(), sin.data_ptr(), meta.slot_mapping.data_ptr(),
            tables.data_ptr(), tables.stride(0), _ptr(meta.block_table_rows), meta.seq_lens.data_ptr(),
            meta.query_start_loc.data_ptr(), meta.seq_lens.shape[0], self.kv_cache.addressing_block_size,
            rows.data_ptr(), rows.shape[0], lora,
        )  # fmt: skip
        scratch = self.scratch(ops, inputs.num_tokens)
        status = ops.pk_decoder(ctypes.byref(self.model), ctypes.byref(step), x.data_ptr(), out.data_ptr(),
                                scratch.data_ptr(), threads)  # fmt: skip
        if status != 0:
            raise RuntimeError(f"pk_decoder failed with status {status}")
        return out
