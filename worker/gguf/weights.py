"""A GGUF file's tensors as the decoder's parameters.

    linear weights in cpu_gguf_linear.NATIVE_TYPES (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K,
    Q6_K), and a tied model's embedding (its lm_head) in one
        -> GgufBlockWeight in `model.quantized`, the file's blocks byte for byte (rows permuted
           back for llama's q/k); the module's .weight stays on the meta device
    F32 / F16 / BF16 tensors                 -> dense, in the compute dtype
    an untied embedding, norms, any tensor of another quant type
        -> dequantized with llama.cpp's numpy reference (gguf.quants) to the compute dtype;
           other quant types on a linear are named in one warning (and in model-info)

Every tensor the decoder needs is checked before any data is read: missing ones and wrong
shapes are a ModelLoadError naming the file, the GGUF tensor, the parameter it feeds and the
field ('ne', the tensor's dims) that disagrees with the metadata.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import torch
from gguf.constants import GGMLQuantizationType as T
from gguf.quants import dequantize

from base.logs import get_logger
from worker.cpu_gguf_linear import NATIVE_TYPE_NAMES, NATIVE_TYPES
from worker.gguf.config import DENSE_TYPES, PERMUTED_ARCHITECTURES, architecture
from worker.gguf.names import gguf_name, permuted_heads, unpermute_rows
from worker.gguf.reader import GgufFile
from worker.model_config import ModelConfig
from worker.quant.gguf_weight import GgufBlockWeight

log = get_logger("pagedkv.worker")
TIED_EMBEDDING = "model.embed_tokens"
"""A tied model's embedding is its lm_head: in a native type it stays blocks too, under this
name in `model.quantized` (the forwards gather its rows; the reference dequantizes it)."""


@dataclass
class GgufWeights:
    dense: dict[str, torch.Tensor]  # parameter name -> tensor (compute dtype, on the device)
    blocks: dict[str, GgufBlockWeight]  # linear module name -> its packed blocks
    dequantized_types: list[str] = field(default_factory=list)  # linears' non-native quant types


def load_gguf_weights(
    gguf: GgufFile,
    config: ModelConfig,
    shapes: Mapping[str, tuple[int, ...]],
    linears: set[str],
    dtype: torch.dtype,
    device: torch.device | str,
) -> GgufWeights:
    """Every parameter in `shapes` (name -> shape the config implies); `linears` are the module
    names whose weight may stay as blocks."""
    plan = _plan(gguf, shapes)
    heads = _permutation(gguf, config)
    tied = TIED_EMBEDDING if config.tie_word_embeddings else None  # the lm_head: kept as blocks
    out = GgufWeights({}, {})
    others: set[str] = set()
    for hf_name, tensor in plan.items():
        module, _, param = hf_name.rpartition(".")
        kind = tensor.tensor_type
        rows = heads(hf_name)
        if param == "weight" and (module in linears or module == tied) and kind in NATIVE_TYPES:
            data = np.asarray(tensor.data)
            data = unpermute_rows(data, rows) if rows else np.array(data)  # both copies: off the mmap
            weight = GgufBlockWeight(torch.from_numpy(data), int(kind), tuple(shapes[hf_name]))
            try:
                weight.check(f"tensor {tensor.name}")
            except ValueError as exc:
                raise gguf.error(str(exc)) from None
            out.blocks[module] = weight
            continue
        if module in linears and kind not in DENSE_TYPES and kind not in NATIVE_TYPES:
            others.add(kind.name)
        dense = _dense(tensor, tuple(shapes[hf_name]))
        if rows:
            dense = unpermute_rows(dense, rows)
        out.dense[hf_name] = torch.from_numpy(np.array(dense)).to(
            device=device, dtype=dtype
        )  # copied off the mmap
    if others:
        out.dequantized_types = sorted(others)
        log.warning(
            "gguf.dequantized_at_load",
            file=str(gguf.path),
            types=", ".join(out.dequantized_types),
            reason="no native kernels for these GGUF types: their linears hold dequantized weights",
            dtype=str(dtype).removeprefix("torch."),
        )
    return out


def gguf_formats(
    weight_format: str, block_types: list[str], dequantized_types: list[str], dtype: str, native_blocks: bool
) -> str:
    """ModelFacts.quantization for a GGUF model: the file's tensor types and how they are held.
    The fast CPU forward runs the native block types as their blocks (worker/cpu_gguf_linear.py);
    the reference and CUDA forwards dequantize them at load (model.py's materialize_quantized)."""
    held = []
    native = [t for t in block_types if native_blocks and t in NATIVE_TYPE_NAMES]
    if native:
        held.append(f"{', '.join(native)} as packed blocks (int8 activations, cpu_gguf.c)")
    if rest := [t for t in block_types if t not in native]:
        held.append(f"{', '.join(rest)} blocks dequantized to {dtype} at load")
    if dequantized_types:
        held.append(f"{', '.join(dequantized_types)}: dense {dtype} (not a block-kernel type)")
    return f"GGUF {weight_format}; {'; '.join(held) or f'dense {dtype}'}"


def _plan(gguf: GgufFile, shapes: Mapping[str, tuple[int, ...]]) -> dict:
    """parameter name -> the file's tensor, checked for presence and shape first."""
    missing, plan = [], {}
    for hf_name, shape in shapes.items():
        name = gguf_name(hf_name)
        tensor = gguf.tensors.get(name)
        if tensor is None:
            missing.append(f"{name} (for {hf_name})")
            continue
        dims = tuple(int(d) for d in reversed(tensor.shape))
        if dims != tuple(shape):
            raise gguf.error(
                f"tensor {name} (for {hf_name}) has field 'ne' {list(reversed(dims))}, i.e. shape {dims}, "
                f"but the metadata implies {tuple(shape)}"
            )
        plan[hf_name] = tensor
    if missing:
        shown = ", ".join(missing[:6]) + (f" (and {len(missing) - 6} more)" if len(missing) > 6 else "")
        raise gguf.error(f"missing tensor(s) {shown}")
    return plan


def _permutation(gguf: GgufFile, config: ModelConfig):
    """hf_name -> heads its rows were permuted in, or None."""
    if architecture(gguf) not in PERMUTED_ARCHITECTURES:
        return lambda hf_name: None
    return lambda hf_name: permuted_heads(hf_name, config.num_heads, config.num_kv_heads)


def _dense(tensor, shape: tuple[int, ...]) -> np.ndarray:
    kind = tensor.tensor_type
    if kind == T.BF16:  # exact: fp32 is bf16 with 16 more mantissa bits
        bits = np.asarray(tensor.data).view(np.uint16).astype(np.uint32) << 16
        return bits.view(np.float32).reshape(shape)
    if kind in (T.F32, T.F16):
        return np.asarray(tensor.data).reshape(shape)
    return dequantize(np.asarray(tensor.data), kind).reshape(shape)
