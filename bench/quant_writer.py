"""Quantized checkpoints written from each format's spec: round-to-nearest quantization and the
packers of AutoAWQ GEMM (WQLinear_GEMM.from_linear's order) and GPTQ (v1 "gptq" / v2 "gptq_v2",
AutoGPTQ's QuantLinear.pack layout), independent of worker/quant (the reader under test).

Used by the quantized tests (tests/worker/quant_checkpoints.py, which pins each packer to words
worked out by hand) and by the benchmarks (`quantize_checkpoint`: a dense checkpoint's decoder
linears as AWQ int4 or GPTQ int8, what `bench.cpu_forward` and `bench.peer` serve).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ: nibble i of word j holds output column 8j + AWQ_ORDER[i]


@dataclass(frozen=True)
class QuantSpec:
    method: str  # "awq" | "gptq" (v1) | "gptq_v2" | "ct" (compressed-tensors)
    bits: int = 4
    group: int = 32  # input features per scale; 0 = one group per output channel
    sym: bool = False
    ct_format: str = "pack-quantized"  # or "int-quantized" (W8A8)
    scale_dtype: torch.dtype = torch.float16

    @property
    def name(self) -> str:
        group = f"g{self.group}" if self.group else "channel"
        fmt = "-w8a8" if self.ct_format == "int-quantized" and self.method == "ct" else ""
        return f"{self.method}{fmt}-int{self.bits}-{group}-{'sym' if self.sym else 'asym'}"


# ---- round-to-nearest quantization (GPTQ's Quantizer / AutoAWQ's pseudo_quantize_tensor math) ----


def rtn(w: Tensor, bits: int, group: int, sym: bool, scale_dtype: torch.dtype, min_zero: int = 0):
    """w [N, K] -> codes int64 [N, K] in [0, 2^bits), scales [N, G] (scale_dtype), zeros int64 [N, G].
    Scales are rounded to their stored dtype before the codes are chosen (what ships is what counts)."""
    n, k = w.shape
    group = group or k
    maxq = (1 << bits) - 1
    g = w.float().view(n, k // group, group)
    lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
    if sym:
        hi = torch.maximum(hi, -lo)
        scales = (2 * hi / maxq).clamp(min=1e-5).to(scale_dtype)
        zeros = torch.full_like(scales, (maxq + 1) // 2, dtype=torch.int64)
    else:
        scales = ((hi - lo) / maxq).clamp(min=1e-5).to(scale_dtype)
        zeros = torch.round(-lo / scales.float()).to(torch.int64).clamp(min_zero, maxq)
    codes = torch.round(g / scales.float()[..., None]).to(torch.int64) + zeros[..., None]
    return codes.clamp(0, maxq).view(n, k), scales, zeros


# ---- packers: unsigned codes -> int32 words ----


def to_int32(words: Tensor) -> Tensor:
    """int64 words in [0, 2^32) -> the int32 tensors checkpoints store (bit pattern kept)."""
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def pack_awq(t: Tensor) -> Tensor:
    """[R, C] 4-bit codes -> int32 [R, C / 8]: nibble i (bits 4i..4i+3) of word j holds column
    8j + AWQ_ORDER[i] (WQLinear_GEMM.from_linear's order_map)."""
    t = t.to(torch.int64)
    words = torch.zeros(t.shape[0], t.shape[1] // 8, dtype=torch.int64)
    for i, column in enumerate(AWQ_ORDER):
        words |= t[:, column::8] << (4 * i)
    return to_int32(words)


def pack_rows(t: Tensor, bits: int) -> Tensor:
    """GPTQ qweight: [K, N] codes -> int32 [K * bits / 32, N]; word r of a column holds rows
    r * (32 / bits) + j at bits j * bits (low bits first)."""
    per, t = 32 // bits, t.to(torch.int64)
    words = torch.zeros(t.shape[0] // per, t.shape[1], dtype=torch.int64)
    for j in range(per):
        words |= t[j::per] << (bits * j)
    return to_int32(words)


def pack_columns(t: Tensor, bits: int) -> Tensor:
    """GPTQ qzeros: [G, N] -> int32 [G, N * bits / 32], along N, low bits first."""
    return pack_rows(t.t(), bits).t().contiguous()


# ---- writers: one layer's tensors, by suffix ----


def write_awq(w: Tensor, spec: QuantSpec) -> dict[str, Tensor]:
    codes, scales, zeros = rtn(w, 4, spec.group, False, spec.scale_dtype)
    return {"qweight": pack_awq(codes.t()), "qzeros": pack_awq(zeros.t()), "scales": scales.t().contiguous()}


def write_gptq(w: Tensor, spec: QuantSpec) -> dict[str, Tensor]:
    v1 = spec.method == "gptq"
    # v1 stores zero - 1 (AutoGPTQ's pack); a zero of 0 would be stored as -1 and smear into the
    # neighbouring fields, so v1 writers never produce one (GPTQ's min <= 0 makes it rare anyway).
    codes, scales, zeros = rtn(w, spec.bits, spec.group, spec.sym, spec.scale_dtype, min_zero=int(v1))
    k = w.shape[1]
    return {
        "qweight": pack_rows(codes.t(), spec.bits),
        "qzeros": pack_columns(zeros.t() - int(v1), spec.bits),
        "scales": scales.t().contiguous(),
        "g_idx": (torch.arange(k) // (spec.group or k)).to(torch.int32),
    }


def gptq_config(spec: QuantSpec) -> dict:
    """quantization_config as AutoGPTQ (v1) / GPTQModel (v2) write it."""
    return {
        "quant_method": "gptq",
        "bits": spec.bits,
        "group_size": spec.group or -1,
        "sym": spec.sym,
        "desc_act": False,
        "damp_percent": 0.01,
        "true_sequential": True,
        "checkpoint_format": spec.method,
    }


def awq_config(spec: QuantSpec) -> dict:
    """quantization_config as AutoAWQ writes it."""
    return {"quant_method": "awq", "bits": 4, "group_size": spec.group, "zero_point": True, "version": "gemm",
            "modules_to_not_convert": None}  # fmt: skip


def write_w8a8(w: Tensor, spec: QuantSpec) -> dict[str, Tensor]:
    """A compressed-tensors `int-quantized` layer (W8A8's weights): int8 codes [N, K] and one
    fp32 scale per output channel, absmax / 127 (symmetric, round to nearest)."""
    scales = (w.float().abs().amax(-1, keepdim=True) / 127).clamp(min=1e-8)
    codes = torch.round(w.float() / scales).clamp(-127, 127).to(torch.int8)
    return {"weight": codes, "weight_scale": scales.to(spec.scale_dtype)}


def w8a8_config(spec: QuantSpec) -> dict:
    """quantization_config as llm-compressor's W8A8 (int8) scheme writes it: int8 channel weights,
    int8 dynamic per-token activations, lm_head ignored."""
    weights = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel", "dynamic": False}
    acts = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}
    group = {"targets": ["Linear"], "weights": weights, "input_activations": acts}
    return {"quant_method": "compressed-tensors", "format": "int-quantized",
            "quantization_status": "compressed", "config_groups": {"group_0": group},
            "ignore": ["lm_head"]}  # fmt: skip


# The quantized weights the benchmarks serve, by name -> (format written over a dense random
# checkpoint, whether the worker also holds the dense lm_head as int8: `--lm-head-int8`, as
# llama.cpp's Q4_0 file keeps its output at Q8_0). AWQ int4 g128 is Qwen3-8B-AWQ's format.
BENCH_QUANTS = {
    "awq-int4": (QuantSpec("awq", 4, 128), False),
    "awq-int4-lmh8": (QuantSpec("awq", 4, 128), True),
    "gptq-int8": (QuantSpec("gptq", 8, 128, sym=True), False),
    "w8a8": (QuantSpec("ct", 8, 0, sym=True, ct_format="int-quantized", scale_dtype=torch.float32), False),
}
INT8_ROW_GROUP = 128  # --lm-head-int8: one fp32 scale and one uint8 zero per row and 128 inputs


def lm_head_int8_bytes(n: int, k: int) -> int:
    """Resident bytes of an [n, k] lm_head held by `--lm-head-int8` (codes + scales + zeros)."""
    return n * k + (n * k // INT8_ROW_GROUP) * 5


def bench_checkpoint(base_dir: Path, name: str) -> Path:
    """`base_dir`'s checkpoint quantized as BENCH_QUANTS[name], cached beside it."""
    spec = BENCH_QUANTS[name][0]
    return quantize_checkpoint(base_dir, base_dir.parent / f"{base_dir.name}-{spec.name}", spec)


DECODER_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def quantize_checkpoint(base_dir: Path, path: Path, spec: QuantSpec) -> Path:
    """`base_dir`'s dense checkpoint (config.json + model.safetensors) with every decoder linear
    (q/k/v/o/gate/up/down; never embeddings or lm_head, as AutoAWQ and GPTQ leave them) written in
    `spec`'s format (awq, gptq, gptq_v2, ct W8A8) to `path`, with config.json's quantization_config."""
    if (path / "model.safetensors").exists():
        return path
    state = load_file(str(base_dir / "model.safetensors"))
    writer = {"awq": write_awq, "ct": write_w8a8}.get(spec.method, write_gptq)
    written = {}
    for key in sorted(state):
        name, _, suffix = key.rpartition(".")
        if suffix == "weight" and name.startswith("model.layers.") and name.endswith(DECODER_LINEARS):
            written[name] = writer(state[key].float(), spec)
    config = {"awq": awq_config, "ct": w8a8_config}.get(spec.method, gptq_config)(spec)
    write_quantized(base_dir, path, written, quantization_config=config, state=state)
    return path


def write_quantized(base_dir: Path, path: Path, written: dict, compressor=None, quantization_config=None,
                    state: dict | None = None) -> None:  # fmt: skip
    """The base checkpoint's tensors with each quantized layer's `.weight` replaced by `written`
    (layer -> {suffix: tensor}); config.json's quantization_config from the library's compressor
    (compressed-tensors) or as given."""
    path.mkdir(parents=True, exist_ok=True)
    config = json.loads((base_dir / "config.json").read_text())
    if quantization_config is not None:
        config["quantization_config"] = quantization_config
    (path / "config.json").write_text(json.dumps(config))
    state = dict(state) if state is not None else load_file(str(base_dir / "model.safetensors"))
    for name, tensors in written.items():
        del state[f"{name}.weight"]
        state.update({f"{name}.{suffix}": tensor for suffix, tensor in tensors.items()})
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    if compressor is not None:
        compressor.update_config(str(path))  # the library writes quantization_config itself
