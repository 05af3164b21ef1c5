"""The CUDA worker's kernels at start: compiled for the attention geometry the worker runs
(the whole model's heads, or a tensor-parallel rank's own), quantized linears swapped for
their packed-code kernels. A geometry or driver the kernels cannot serve fails the start."""

from __future__ import annotations

import torch
from torch import nn

from kernels.driver import KernelLoadError
from kernels.nvrtc import KernelCompileError
from kernels.specs import AttentionGeometry
from worker.cuda_quant import replace_quantized_linears
from worker.errors import WorkerConfigError
from worker.model_config import ModelConfig
from worker.quant.gguf_weight import GgufBlockWeight


def kernel_geometry(
    config: ModelConfig, shard, dtype: torch.dtype, block_size: int, kv_cache_dtype: str
) -> AttentionGeometry:
    """The geometry the attention kernels are compiled for: `shard`'s local heads (its query
    heads and the KV heads it holds: the GQA group, hence the decode kernel's head tile,
    differs from the whole model's when KV heads are replicated) on a tensor-parallel rank,
    else the model's. The attention launches derive the same from the tensors they get."""
    heads = (config.num_heads, config.num_kv_heads)
    if shard is not None:
        heads = (shard.num_heads, shard.num_kv_heads)
    return AttentionGeometry(
        dtype=str(dtype).removeprefix("torch."),
        head_dim=config.head_dim,
        block_size=block_size,
        num_heads=heads[0],
        num_kv_heads=heads[1],
        kv_cache_dtype=kv_cache_dtype,  # quantized pools: their kernels (issue 31)
    )


def prepare_kernels(model: nn.Module, backend, geometry: AttentionGeometry, dtype, device) -> None:
    """Compile and load the kernels now (a bad geometry or driver fails at start) and swap
    quantized linears for their packed-code kernels."""
    try:
        backend.prepare(geometry)
        if any(isinstance(w, GgufBlockWeight) for w in model.quantized.values()):
            model.materialize_quantized(dtype, device)  # no CUDA block kernels yet
        elif model.quantized:  # served from packed codes (worker/cuda_quant.py)
            replace_quantized_linears(model, dtype, backend)
    except (ValueError, KernelLoadError, KernelCompileError) as exc:
        raise WorkerConfigError(f"the CUDA kernels cannot serve this model on {device}: {exc}") from exc
