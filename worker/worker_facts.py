"""What a worker says about itself (WorkerInfo: ModelFacts plus its instance): the model,
the KV pool, which forward and kernels run, quantization, the memory breakdown, CUDA graphs,
a draft model and image geometry. Read once at start (Worker.describe)."""

from __future__ import annotations

from pathlib import Path

from base.plan import WorkerInfo
from worker.gguf.reader import open_gguf
from worker.gguf.tokenizer import tokenizer_json
from worker.gguf.weights import gguf_formats
from worker.graph_check import graph_facts
from worker.kv_quant import describe_scales


def describe(worker) -> WorkerInfo:
    config = worker.model_config
    tokenizer_kind, tokenizer_json = _tokenizer(worker.model_dir, config.tokenizer_hint)
    return WorkerInfo(
        model_name=config.model_name_hint or worker.model_dir.resolve().name,
        architecture=config.architecture,
        vocab_size=config.vocab_size,
        max_model_len=worker.max_model_len,
        num_layers=config.num_layers,
        num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        dtype=str(worker.dtype).removeprefix("torch."),
        block_size=worker.config.block_size,
        num_blocks=worker.kv_cache.reported_num_blocks,
        bytes_per_block=worker.kv_spec.bytes_per_block,
        device=str(worker.device),
        instance_id=worker.instance_id,
        eos_token_ids=config.eos_token_ids,
        kv_layout=worker.config.layout,
        max_concurrent_seqs=worker.kv_cache.max_concurrent_seqs,
        tokenizer_kind=tokenizer_kind,
        forward=worker.forward_kind,
        forward_kernels=worker.forward_kernels,
        forward_fallback_reason=worker.forward_fallback_reason,
        quantization=_quantization(worker),
        kv_cache_dtype=worker.kv_spec.kv_cache_dtype,
        kv_cache_scales=describe_scales(worker.kv_spec.kv_format, worker.kv_tensor_scales),
        memory=worker.memory,
        **graph_facts(worker.graph_decision),
        sliding_window=worker.window_of_every_layer(),
        draft_model=_draft_facts(worker),
        tokenizer_json=tokenizer_json,
        **_image_facts(worker),
    )


def _draft_facts(worker) -> str:
    if worker.draft is None:
        return ""
    spec = worker.draft.kv_cache.spec
    return f"{worker.draft.name} ({spec.num_layers} layers, {spec.bytes_per_block} bytes/block)"


def _image_facts(worker) -> dict[str, int]:
    mm = worker.model_config.multimodal
    if mm is None:
        return {}
    return dict(
        image_token_id=mm.image_token_id,
        vision_start_token_id=mm.vision_start_token_id,
        vision_end_token_id=mm.vision_end_token_id,
        image_patch_size=mm.geometry.patch_size,
        image_merge_size=mm.geometry.merge_size,
        image_min_pixels=mm.geometry.min_pixels,
        image_max_pixels=mm.geometry.max_pixels,
    )


def _quantization(worker) -> str:
    """ModelFacts.quantization: the checkpoint's scheme and how the forward holds it."""
    scheme = worker.model_config.quantization
    dense = str(worker.dtype).removeprefix("torch.")
    if worker.model_config.weight_format:
        return gguf_formats(worker.model_config.weight_format, worker.model.gguf_dequantized_types, dense)
    if scheme is None:
        return ""
    packed = worker.fast_forward is not None or worker.device.type == "cuda"
    held = "packed codes" if packed else f"dequantized to {dense}"
    return f"{scheme.describe()}; {held}"


def _tokenizer(model_dir: Path, hint: str | None) -> tuple[str, str]:
    if hint == "byte":
        return "byte", ""
    if model_dir.suffix.lower() == ".gguf":  # built from its tokenizer.ggml.* metadata, if any
        gguf = open_gguf(model_dir)
        return ("hf", tokenizer_json(gguf)) if gguf.has("tokenizer.ggml.model") else ("none", "")
    tokenizer_path = model_dir / "tokenizer.json"
    if tokenizer_path.is_file():
        return "hf", tokenizer_path.read_text(encoding="utf-8")
    return "none", ""
