"""The vision side of a Qwen3-VL or Qwen2.5-VL checkpoint: `config.json`'s `vision_config` and
token ids, and the image processor's settings from `preprocessor_config.json` (the model's
published defaults for keys it leaves out). The text side is parsed by worker.model_config like
any Qwen3 (Qwen3-VL) or Qwen2 (Qwen2.5-VL) decoder."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from base.vision import ImageGeometry
from worker.errors import ModelLoadError
from worker.vision.preprocess import ImageNormalization

QWEN3_VL = "Qwen3VLForConditionalGeneration"
QWEN2_5_VL = "Qwen2_5_VLForConditionalGeneration"
# The published preprocessor_config.json values, used for any key the file leaves out.
DEFAULT_PROCESSOR = {
    QWEN3_VL: {
        "patch_size": 16,
        "merge_size": 2,
        "temporal_patch_size": 2,
        "min_pixels": 65536,
        "max_pixels": 16777216,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
    },
    QWEN2_5_VL: {
        "patch_size": 14,
        "merge_size": 2,
        "temporal_patch_size": 2,
        "min_pixels": 56 * 56,
        "max_pixels": 28 * 28 * 1280,
        "image_mean": [0.48145466, 0.4578275, 0.40821073],  # OpenAI CLIP's
        "image_std": [0.26862954, 0.26130258, 0.27577711],
    },
}


@dataclass(frozen=True, slots=True)
class VisionConfig:
    """Both towers' settings. Qwen3-VL: learned position table, DeepStack; Qwen2.5-VL: windowed
    attention except in `fullatt_block_indexes`, RMSNorm and gated-MLP blocks."""

    architecture: str
    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    in_channels: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    out_hidden_size: int
    num_position_embeddings: int
    deepstack_visual_indexes: tuple[int, ...]
    hidden_act: str
    rope_theta: float
    window_size: int = 0  # Qwen2.5-VL: window side in pixels
    fullatt_block_indexes: tuple[int, ...] = ()  # Qwen2.5-VL: blocks attending to the whole image


@dataclass(frozen=True, slots=True)
class MultimodalConfig:
    """What the worker and the control plane need beyond the decoder: the tower, the image
    token ids, how rotary frequencies split over (t, h, w), and the processor's geometry."""

    vision: VisionConfig
    image_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int
    mrope_section: tuple[int, int, int]
    mrope_interleaved: bool
    geometry: ImageGeometry
    normalization: ImageNormalization


def parse_multimodal(
    architecture: str, config: dict[str, Any], rope_params: dict[str, Any], model_dir: Path | None
) -> MultimodalConfig:
    vision = config.get("vision_config")
    if not isinstance(vision, dict):
        raise ModelLoadError("config.json: a vision-language model needs a vision_config object")
    qwen3 = architecture == QWEN3_VL
    try:
        vision_config = VisionConfig(
            architecture=architecture,
            depth=int(vision["depth"]),
            hidden_size=int(vision["hidden_size"]),
            intermediate_size=int(vision["intermediate_size"]),
            num_heads=int(vision["num_heads"]),
            in_channels=int(vision.get("in_channels", 3)),
            patch_size=int(vision["patch_size"]),
            temporal_patch_size=int(vision.get("temporal_patch_size", 2)),
            spatial_merge_size=int(vision.get("spatial_merge_size", 2)),
            out_hidden_size=int(vision["out_hidden_size"]),
            num_position_embeddings=int(vision["num_position_embeddings"]) if qwen3 else 0,
            deepstack_visual_indexes=tuple(int(i) for i in vision.get("deepstack_visual_indexes", ())),
            hidden_act=str(vision.get("hidden_act", "gelu_pytorch_tanh" if qwen3 else "silu")),
            rope_theta=float((vision.get("rope_parameters") or {}).get("rope_theta", 10000.0)),
            window_size=0 if qwen3 else int(vision["window_size"]),
            fullatt_block_indexes=() if qwen3 else tuple(int(i) for i in vision["fullatt_block_indexes"]),
        )
        section = tuple(int(s) for s in rope_params["mrope_section"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelLoadError(f"config.json: incomplete vision-language settings: {exc!r}") from exc
    if len(section) != 3:
        raise ModelLoadError(f"config.json: mrope_section must have 3 entries, got {section}")
    supported_acts = ("gelu_pytorch_tanh", "gelu") if qwen3 else ("silu",)
    if vision_config.hidden_act not in supported_acts:
        raise ModelLoadError(f"config.json: vision hidden_act {vision_config.hidden_act!r} is not supported")
    processor = _processor_settings(model_dir, DEFAULT_PROCESSOR[architecture])
    if (
        processor["patch_size"] != vision_config.patch_size
        or processor["merge_size"] != vision_config.spatial_merge_size
    ):
        raise ModelLoadError("preprocessor_config.json: patch_size/merge_size disagree with vision_config")
    return MultimodalConfig(
        vision=vision_config,
        image_token_id=_token_id(config, "image_token_id"),
        vision_start_token_id=_token_id(config, "vision_start_token_id"),
        vision_end_token_id=_token_id(config, "vision_end_token_id"),
        mrope_section=section,  # type: ignore[arg-type]
        mrope_interleaved=bool(rope_params.get("mrope_interleaved", False)),
        geometry=ImageGeometry(
            patch_size=processor["patch_size"],
            merge_size=processor["merge_size"],
            temporal_patch_size=processor["temporal_patch_size"],
            min_pixels=processor["min_pixels"],
            max_pixels=processor["max_pixels"],
        ),
        normalization=ImageNormalization(
            mean=tuple(float(v) for v in processor["image_mean"]),  # type: ignore[arg-type]
            std=tuple(float(v) for v in processor["image_std"]),  # type: ignore[arg-type]
        ),
    )


def _token_id(config: dict[str, Any], key: str) -> int:
    value = config.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ModelLoadError(f"config.json: a vision-language model needs {key}, got {value!r}")
    return value


def _processor_settings(model_dir: Path | None, defaults: dict[str, Any]) -> dict[str, Any]:
    settings = dict(defaults)
    path = None if model_dir is None else model_dir / "preprocessor_config.json"
    if path is None or not path.is_file():
        return settings
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from exc
    size = data.get("size") or {}
    for key in ("patch_size", "merge_size", "temporal_patch_size", "image_mean", "image_std"):
        if data.get(key) is not None:
            settings[key] = data[key]
    # Both spellings: size.{shortest,longest}_edge (transformers 5) and min/max_pixels (older).
    settings["min_pixels"] = int(
        data.get("min_pixels") or size.get("shortest_edge") or settings["min_pixels"]
    )
    settings["max_pixels"] = int(data.get("max_pixels") or size.get("longest_edge") or settings["max_pixels"])
    return settings
