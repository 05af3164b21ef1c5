"""The worker's settings and how each default is resolved.

model            None -> the embedded default model (worker.default_model);
                 "random:<preset>" -> a random-weight preset (benchmarks);
                 otherwise a local Hugging Face checkpoint directory (never downloaded).
device           "cpu" (reference backend) or "cuda[:N]" (kernels).
dtype            None / "auto" -> the checkpoint's dtype; or float32 / float16 / bfloat16.
block_size       tokens per KV block, a power of two.
num_blocks       explicit pool size (including the null block); wins over kv_cache_memory.
kv_cache_memory  KV budget in bytes; default 256 MiB on CPU, on CUDA what the memory
                 profile leaves under gpu_memory_utilization.
kv_layout        "paged" or "contiguous" (the baseline).
kv_cache_dtype   "auto" (the model's dtype) or a quantized KV cache: "fp8_e4m3", "fp8_e5m2",
                 "int8" (1-byte codes + a scale byte per token and kv head: ~2x the blocks of
                 bf16 in the same memory; worker/kv_quant.py). CPU, paged layout only: other
                 backends refuse it at start with the reason.
max_model_len    cap on positions per sequence; default and ceiling: the model's
                 max_position_embeddings.
seed             seed of the sampler's generator for requests without their own seed.
cuda_graph       "on" (default): capture decode steps in CUDA graphs (CUDA device, paged
                 layout only) and keep them if the start-time self-check finds a replay's
                 logits equal to eager's within the tolerance (worker/graph_check.py), else
                 serve eager and say why; "require": the same, but a failed self-check
                 refuses to start; "off": eager decode. True / False mean "on" / "off".
                 `pagedkv worker --cuda-graph off|on|require` (--no-cuda-graph = off).
gpu_memory_utilization
                 CUDA: the fraction of the device's memory the worker sizes itself to; the
                 KV pool gets what a profiled start leaves of it (worker/memory_profile.py).
                 An explicit num_blocks or kv_cache_memory wins. Ignored on the CPU.
max_num_batched_tokens
                 the largest prefill the control plane sends in one step: what the CUDA
                 memory profile runs (`serve` passes its own --max-num-batched-tokens).
cpu_kernels      "auto" (default): the fused CPU forward (worker.cpu_forward: panel GEMMs and C
                 kernels, prebuilt at install or built at start) when it can run here, else
                 the reference, with one warning saying why; "fast": the fused forward or
                 refuse to start (the reason is the error); "reference": the plain torch
                 model, the oracle. Which ran is in ModelFacts.forward. Ignored on CUDA.
lm_head_int8     hold a dense lm_head (or a tied embedding) as int8 codes, one scale per row and 128
                 inputs, on the fused CPU forward: ~half of bf16's bytes per decoded token for
                 the largest layer of small models (llama.cpp keeps Q4_0 files' output at Q8_0
                 the same way); logits move by ~1e-3 relative. Off by default.
draft_model      None, or the draft model of `--speculative draft` (a directory or "random:<preset>",
                 as `model`): same vocabulary as the target, run on the CPU worker with its own
                 paged pool of the target's num_blocks (worker/draft_model.py); the KV budget is
                 split between the two pools by their bytes per block.
max_loras        LoRA adapters resident in memory at once (and at most in one step); more may be
                 registered: an evicted one is read back from its files when a step needs it.
max_lora_rank    the largest adapter rank accepted (a larger one is refused at load).
loras            (name, path) PEFT adapters registered at start (`--lora NAME=PATH`).
cuda_graph_max_batch_size
                 largest decode batch run through a graph (buckets 1, 2, 4, ... up to it);
                 bigger decode batches and every step with a prefill run eagerly. Match the
                 control plane's max_num_seqs (default 64) to graph every decode step. Also
                 the decode batch (and sampler batch) the CUDA memory profile runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from base.plan import KVLayout
from worker.default_model import default_model_dir, ensure_random_model
from worker.errors import ModelLoadError, WorkerConfigError
from worker.gguf import find_gguf
from worker.kv_quant import KV_CACHE_DTYPES
from worker.model_config import SUPPORTED_DTYPES

CPU_DEFAULT_KV_MEMORY = 256 << 20
DEFAULT_GPU_MEMORY_UTILIZATION = 0.90
CUDA_GRAPH_MODES = ("off", "on", "require")
RANDOM_MODEL_PREFIX = "random:"
KV_LAYOUTS = {"paged": KVLayout.PAGED, "contiguous": KVLayout.CONTIGUOUS}
CPU_KERNELS = ("auto", "fast", "reference")


@dataclass(slots=True)
class WorkerConfig:
    model: str | None = None
    device: str = "cpu"
    dtype: str | None = None
    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_memory: int | None = None
    kv_layout: str = "paged"
    max_model_len: int | None = None
    seed: int = 0
    cuda_graph: str | bool = "on"  # "off" | "on" | "require" (bools: "on" / "off")
    cuda_graph_max_batch_size: int = 64
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION
    max_num_batched_tokens: int = 2048
    cpu_kernels: str = "auto"
    lm_head_int8: bool = False
    kv_cache_dtype: str = "auto"
    draft_model: str | None = None
    max_loras: int = 4
    max_lora_rank: int = 64
    loras: tuple[tuple[str, str], ...] = ()

    def validate(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise WorkerConfigError(f"block_size must be a power of two, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 2:
            raise WorkerConfigError(
                f"num_blocks must be >= 2 (block 0 is the null block), got {self.num_blocks}"
            )
        if self.kv_cache_memory is not None and self.kv_cache_memory < 1:
            raise WorkerConfigError(
                f"kv_cache_memory must be a positive number of bytes, got {self.kv_cache_memory}"
            )
        if self.kv_layout not in KV_LAYOUTS:
            raise WorkerConfigError(
                f"kv_layout must be one of {', '.join(KV_LAYOUTS)}, got {self.kv_layout!r}"
            )
        if self.max_model_len is not None and self.max_model_len < 1:
            raise WorkerConfigError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.cpu_kernels not in CPU_KERNELS:
            raise WorkerConfigError(
                f"cpu_kernels must be one of {', '.join(CPU_KERNELS)}, got {self.cpu_kernels!r}"
            )
        if self.cuda_graph_max_batch_size < 1:
            raise WorkerConfigError(
                f"cuda_graph_max_batch_size must be >= 1, got {self.cuda_graph_max_batch_size}"
            )
        if self.graph_mode not in CUDA_GRAPH_MODES:
            raise WorkerConfigError(
                f"cuda_graph must be one of {', '.join(CUDA_GRAPH_MODES)}, got {self.cuda_graph!r}"
            )
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise WorkerConfigError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.max_num_batched_tokens < 1:
            raise WorkerConfigError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise WorkerConfigError(
                f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}"
            )
        if self.dtype not in (None, "auto", *SUPPORTED_DTYPES):
            raise WorkerConfigError(
                f"dtype must be 'auto' or one of {', '.join(SUPPORTED_DTYPES)}, got {self.dtype!r}"
            )

    @property
    def graph_mode(self) -> str:
        """cuda_graph as "off" | "on" | "require" (a bool means "on" / "off")."""
        if isinstance(self.cuda_graph, bool):
            return "on" if self.cuda_graph else "off"
        return self.cuda_graph

    @property
    def layout(self) -> KVLayout:
        return KV_LAYOUTS[self.kv_layout]


def resolve_model_dir(model: str | None) -> Path:
    """The checkpoint `--model` names: a Hugging Face directory, a .gguf file (also when the
    directory holds exactly one and no config.json), or a random preset's cached directory."""
    if model is None:
        return default_model_dir()
    if model.startswith(RANDOM_MODEL_PREFIX):
        try:
            return ensure_random_model(model.removeprefix(RANDOM_MODEL_PREFIX))
        except ValueError as exc:
            raise ModelLoadError(str(exc)) from exc
    path = Path(model).expanduser()
    try:
        gguf = find_gguf(path)
    except ValueError as exc:
        raise ModelLoadError(str(exc)) from None
    if gguf is not None:
        return gguf
    if not path.is_dir():
        raise ModelLoadError(
            f"model {model!r} is neither a directory nor a .gguf file. The worker never downloads: fetch "
            "a checkpoint first, e.g. `huggingface-cli download Qwen/Qwen3-0.6B --local-dir ./Qwen3-0.6B`, "
            "and pass its path"
        )
    return path


def resolve_dtype(requested: str | None, checkpoint_dtype: str) -> torch.dtype:
    name = checkpoint_dtype if requested in (None, "auto") else requested
    return getattr(torch, name)


def resolve_device(device: str) -> torch.device:
    try:
        resolved = torch.device(device)
    except RuntimeError as exc:
        raise WorkerConfigError(f"invalid device {device!r}: {exc}") from exc
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            raise WorkerConfigError(f"device {device!r} requested but torch sees no CUDA device")
        if resolved.index is None:
            resolved = torch.device("cuda", torch.cuda.current_device())
    return resolved


def resolve_max_model_len(requested: int | None, max_position_embeddings: int) -> int:
    if requested is None:
        return max_position_embeddings
    if requested > max_position_embeddings:
        raise WorkerConfigError(
            f"max_model_len {requested} exceeds the model's max_position_embeddings {max_position_embeddings}"
        )
    return requested


def kv_sizing(config: WorkerConfig, profiled: bool) -> str:
    """How the KV pool is sized (MemoryBreakdown.sizing): an explicit flag wins; else the
    profile (CUDA), or the fixed default (CPU)."""
    if config.num_blocks is not None:
        return "num_blocks"
    if config.kv_cache_memory is not None:
        return "kv_cache_memory"
    return "profiled" if profiled else "default"
