"""Quantized test checkpoints and their oracles, written from each format's spec, never from
worker/quant (the code under test).

Writers: AutoAWQ GEMM and GPTQ (v1 "gptq" and v2 "gptq_v2") are packed by bench/quant_writer.py
(shared with the benchmarks), by round-to-nearest quantization of a tiny random model's decoder
linears (q/k/v/o/gate/up/down; never embeddings or lm_head), in the layout AutoAWQ's
WQLinear_GEMM.from_linear and AutoGPTQ's QuantLinear.pack write; tests/worker/test_quant_formats.py
pins each packer to words worked out by hand. compressed-tensors
checkpoints are written by the compressed_tensors library itself (apply_quantization_config, its
min/max qparams, ModelCompressor.compress_model, ModelCompressor.update_config for config.json).

Oracles: `dequantize_layer` turns a checkpoint's tensors (read back from the file) into the dense
fp32 weight each format's spec defines; `quantized_checkpoint` loads those into a copy of the
float32 Hugging Face model, the model pagedkv must match.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import Tensor

from bench.quant_writer import (  # noqa: F401  (re-exported: the tests import them from here)
    AWQ_ORDER,
    QuantSpec,
    awq_config,
    gptq_config,
    pack_awq,
    pack_columns,
    pack_rows,
    rtn,
    to_int32,
    write_awq,
    write_gptq,
    write_quantized,
)

LLAMA, QWEN2, QWEN3 = "llama-gqa-derived-head-dim", "qwen2-mqa-bias", "qwen3-head-dim-tied"
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
# Every format pagedkv serves, each on one of the three families in turn (Qwen2: biases and a
# single 16-wide kv head; Qwen3: head_dim 32, q/k norms, tied lm_head; Llama: derived head_dim).
VARIANTS = [
    (QuantSpec("awq", 4, 32), QWEN2),
    (QuantSpec("awq", 4, 64), LLAMA),
    (QuantSpec("gptq", 4, 32, sym=True), QWEN3),
    (QuantSpec("gptq", 4, 64), LLAMA),
    (QuantSpec("gptq", 8, 32, sym=True), QWEN2),
    (QuantSpec("gptq", 8, 32), QWEN3),
    (QuantSpec("gptq_v2", 4, 32, sym=True), LLAMA),
    (QuantSpec("gptq_v2", 4, 64), QWEN2),
    (QuantSpec("gptq_v2", 8, 0, sym=True), QWEN3),
    (QuantSpec("gptq_v2", 8, 64), LLAMA),
    (QuantSpec("ct", 4, 32, sym=True, scale_dtype=BF16), QWEN2),  # W4A16
    (QuantSpec("ct", 4, 64, sym=False, scale_dtype=FP16), QWEN3),  # W4A16_ASYM
    (QuantSpec("ct", 4, 0, sym=True, scale_dtype=FP32), LLAMA),
    (QuantSpec("ct", 4, 0, sym=False, scale_dtype=BF16), QWEN2),
    (QuantSpec("ct", 8, 32, sym=False, scale_dtype=BF16), QWEN3),  # W8A16
    (QuantSpec("ct", 8, 0, sym=True, scale_dtype=FP16), QWEN2),
    (QuantSpec("ct", 8, 0, sym=True, ct_format="int-quantized", scale_dtype=FP32), LLAMA),  # W8A8
]
VARIANT_IDS = [f"{spec.name}-{family.split('-')[0]}" for spec, family in VARIANTS]


def quantized_layers(model) -> list[str]:
    """The decoder's linear layers (what AutoAWQ / GPTQ quantize; compressed-tensors ignores lm_head)."""
    return [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n.startswith("model.")]


# ---- unpackers (the oracle side) ----


def _bits(words: Tensor, shift: int, bits: int) -> Tensor:
    return ((words.to(torch.int64) & 0xFFFFFFFF) >> shift) & ((1 << bits) - 1)


def unpack_awq(words: Tensor) -> Tensor:
    out = torch.empty(words.shape[0], words.shape[1] * 8, dtype=torch.int64)
    for i, column in enumerate(AWQ_ORDER):
        out[:, column::8] = _bits(words, 4 * i, 4)
    return out


def unpack_rows(words: Tensor, bits: int) -> Tensor:
    per = 32 // bits
    out = torch.empty(words.shape[0] * per, words.shape[1], dtype=torch.int64)
    for j in range(per):
        out[j::per] = _bits(words, bits * j, bits)
    return out


def ct_quantization_config(spec: QuantSpec):
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme

    strategy = "group" if spec.group else "channel"
    weights = QuantizationArgs(num_bits=spec.bits, type="int", symmetric=spec.sym, strategy=strategy,
                               group_size=spec.group or None)  # fmt: skip
    acts = None
    if spec.ct_format == "int-quantized":  # W8A8: int8 dynamic per-token activations
        acts = QuantizationArgs(num_bits=8, type="int", strategy="token", symmetric=True, dynamic=True)
    scheme = QuantizationScheme(targets=["Linear"], weights=weights, input_activations=acts)
    return QuantizationConfig(config_groups={"group_0": scheme}, format=spec.ct_format, ignore=["lm_head"])


def write_compressed_tensors(hf_model, spec: QuantSpec, qconfig=None):
    """The compressed_tensors library quantizes and compresses a copy of `hf_model`: returns its
    tensors of the quantized layers (module name -> {suffix: tensor}) and the ModelCompressor that
    writes config.json's quantization_config."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import apply_quantization_config
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    model = copy.deepcopy(hf_model)
    qconfig = qconfig or ct_quantization_config(spec)
    apply_quantization_config(model, qconfig, show_progress=False)
    for _, module in model.named_modules():
        scheme = getattr(module, "quantization_scheme", None)
        if scheme is None:
            continue
        args, w = scheme.weights, module.weight.data  # min/max per group: llm-compressor's minmax observer
        groups = w.view(w.shape[0], -1, args.group_size) if args.strategy == "group" else w[:, None, :]
        scale, zero = calculate_qparams(groups.amin(-1), groups.amax(-1), args)
        module.weight_scale = torch.nn.Parameter(scale.to(spec.scale_dtype), requires_grad=False)
        if hasattr(module, "weight_zero_point"):
            module.weight_zero_point.data.copy_(zero)
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=qconfig.format)
    compressor.compress_model(model)
    state = model.state_dict()
    out = {}
    for name in quantized_layers(hf_model):
        out[name] = {k[len(name) + 1 :]: v.contiguous() for k, v in state.items() if k.startswith(name + ".")}
        out[name].pop("bias", None)  # biases stay dense tensors, as the base checkpoint has them
    return out, compressor


# ---- oracles: checkpoint tensors -> dense fp32 [N, K] ----


def dequantize_layer(spec: QuantSpec, t: dict[str, Tensor]) -> Tensor:
    """The dense weight [N, K] the format's spec defines, from one layer's tensors (by suffix)."""
    if spec.method == "awq":  # W[k, n] = (q - z[k // g, n]) * s[k // g, n], stored [K, N]
        g = t["qweight"].shape[0] // t["scales"].shape[0]
        q, z = unpack_awq(t["qweight"]), unpack_awq(t["qzeros"]).repeat_interleave(g, 0)
        return ((q - z) * t["scales"].float().repeat_interleave(g, 0)).t().contiguous()
    if spec.method in ("gptq", "gptq_v2"):  # groups by g_idx, as GPTQ kernels index them
        q = unpack_rows(t["qweight"], spec.bits)
        z = unpack_rows(t["qzeros"].t(), spec.bits).t() + (spec.method == "gptq")
        g_idx = t["g_idx"].long()
        return ((q - z[g_idx]) * t["scales"].float()[g_idx]).t().contiguous()
    if spec.ct_format == "int-quantized":  # W = q * s per output channel
        return t["weight"].float() * t["weight_scale"].float()
    n, k = (int(v) for v in t["weight_shape"])
    offset = 1 << (spec.bits - 1)  # codes are stored as signed value + 2^(bits-1)
    q = unpack_rows(t["weight_packed"].t(), spec.bits).t()[:, :k] - offset
    s = t["weight_scale"].float()
    g = k // s.shape[1]
    zp = torch.zeros_like(s) if spec.sym else unpack_rows(t["weight_zero_point"], spec.bits)[:n] - offset
    return (q - zp.repeat_interleave(g, 1)) * s.repeat_interleave(g, 1)


def library_int8_tokens(_module, args):
    """W8A8's activations in the oracle: the compressed_tensors library's own fake quantization
    (its rounding and clamp to int8) at one scale per token, absmax / 127 as vLLM's dynamic int8
    quantization computes it (the library's calibration helper would divide by 127.5)."""
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize

    x = args[0]
    amax = x.abs().amax(-1, keepdim=True)
    scale = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    acts = QuantizationArgs(num_bits=8, type="int", strategy="token", symmetric=True, dynamic=True)
    return (fake_quantize(x, scale, torch.zeros_like(scale), acts), *args[1:])


def ct_library_dequantize(spec: QuantSpec, t: dict[str, Tensor], qconfig) -> Tensor:
    """Second oracle for compressed-tensors: the library's own decompressor on the same tensors."""
    from compressed_tensors.compressors import BaseCompressor

    scheme = qconfig.config_groups["group_0"]
    compressor = BaseCompressor.get_value_from_registry(spec.ct_format)
    return compressor.decompress(dict(t), scheme)["weight"].float()


# ---- whole checkpoints ----


@dataclass
class QuantizedCheckpoint:
    path: Path
    spec: QuantSpec
    hf_model: object  # float32 transformers model holding the oracle's dense weights
    tensors: dict[str, dict[str, Tensor]]  # layer -> {suffix: tensor}, as written
    dense: dict[str, Tensor]  # layer -> oracle weight [N, K]
    qconfig: object = None  # compressed-tensors: the library's QuantizationConfig


def quantized_checkpoint(base_dir: Path, hf_model, spec: QuantSpec, path: Path) -> QuantizedCheckpoint:
    """Write `spec`'s checkpoint of the model in `base_dir` (a dense checkpoint and its fp32 HF
    model, tests/worker/worker_test_utils.py) to `path`; the oracle reads the tensors back."""
    layers = quantized_layers(hf_model)
    if spec.method == "ct":
        written, compressor = write_compressed_tensors(hf_model, spec)
        write_quantized(base_dir, path, written, compressor=compressor)
    else:
        writer = write_awq if spec.method == "awq" else write_gptq
        written = {name: writer(hf_model.get_submodule(name).weight.detach(), spec) for name in layers}
        write_quantized(
            base_dir,
            path,
            written,
            quantization_config=(awq_config if spec.method == "awq" else gptq_config)(spec),
        )
        compressor = None
    on_disk = load_file(str(path / "model.safetensors"))
    tensors = {n: {s: on_disk[f"{n}.{s}"] for s in written[n]} for n in layers}
    dense = {name: dequantize_layer(spec, tensors[name]) for name in layers}
    oracle = copy.deepcopy(hf_model)
    with torch.no_grad():
        for name in layers:
            oracle.get_submodule(name).weight.copy_(dense[name])
            if spec.ct_format == "int-quantized":
                oracle.get_submodule(name).register_forward_pre_hook(library_int8_tokens)
    qconfig = None if compressor is None else compressor.quantization_config
    return QuantizedCheckpoint(path, spec, oracle.eval(), tensors, dense, qconfig)
