"""What a worker says about itself (WorkerInfo: ModelFacts plus its instance): the model,
the KV pool, which forward and kernels run, quantization, the memory breakdown, CUDA graphs,
a draft model and image geometry. Read once at start (Worker.describe)."""

from __future__ import annotations

import json
from pathlib import Path

from base.plan import WorkerInfo
from worker.gguf.reader import open_gguf
from worker.gguf.tokenizer import tokenizer_config, tokenizer_json
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
        max_loras=worker.lora.registry.max_loras,
        max_lora_rank=worker.lora.registry.max_rank,
        tokenizer_json=tokenizer_json,
        tokenizer_config_json=_chat_facts(worker.model_dir),
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
        model = worker.model
        return gguf_formats(
            worker.model_config.weight_format,
            model.gguf_block_types,
            model.gguf_dequantized_types,
            dense,
            native_blocks=worker.fast_forward is not None,
        )
    if scheme is None:
        return ""
    packed = worker.fast_forward is not None or worker.device.type == "cuda"
    held = "packed codes" if packed else f"dequantized to {dense}"
    return f"{scheme.describe()}; {held}"


_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")


def _chat_facts(model_dir: Path) -> str:
    """ModelFacts.tokenizer_config_json: the chat template and special-token strings, from a
    GGUF file's metadata or a checkpoint's tokenizer_config.json (+ chat_template.jinja); ""
    when there is no template."""
    if model_dir.suffix.lower() == ".gguf":
        config = tokenizer_config(open_gguf(model_dir))
    else:
        try:
            raw = json.loads((model_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            raw = {}
        template = raw.get("chat_template") if isinstance(raw, dict) else None
        if isinstance(template, list):  # named templates: the default one
            template = next((t.get("template") for t in template if t.get("name") == "default"), None)
        jinja = model_dir / "chat_template.jinja"
        if not isinstance(template, str) and jinja.is_file():
            template = jinja.read_text(encoding="utf-8")
        config = {k: raw[k] for k in _SPECIAL_KEYS if isinstance(raw, dict) and raw.get(k) is not None}
        config["chat_template"] = template if isinstance(template, str) else None
    return json.dumps(config, ensure_ascii=False) if config.get("chat_template") else ""


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
