"""Encoded image bytes -> the vision tower's input, equal to Hugging Face's Qwen2-VL/Qwen3-VL
image processor (its Pillow backend) on the same image:

    decode (Pillow) -> RGB (transparency composited on white) -> resize to smart_resize's size
    (bicubic, Pillow) -> x / 255 (float64, then float32) -> (x - mean) / std (float32)
    -> patchify

Patchify orders patches by merge square, so the merger's `merge x merge` groups are consecutive
rows, and repeats each patch `temporal_patch_size` times (an image is a one-frame video):

    rows: for each merged token (row-major over the merged grid), its merge x merge patches
    cols: channel, temporal copy, patch row, patch column  (C * T * P * P values)
"""

from __future__ import annotations

import io
from dataclasses import dataclass

import numpy as np
from PIL import Image

from base.vision import ImageGeometry, smart_resize


class ImageDecodeError(ValueError):
    """Bytes that are not an image Pillow can decode."""


@dataclass(frozen=True, slots=True)
class ImageNormalization:
    mean: tuple[float, float, float]
    std: tuple[float, float, float]


@dataclass(slots=True)
class PreprocessedImage:
    patches: np.ndarray  # float32 [grid_h * grid_w, 3 * temporal * patch * patch]
    grid_thw: tuple[int, int, int]


def decode_rgb(data: bytes) -> Image.Image:
    """Decode fully (a truncated file fails here, not later) and convert to RGB the way the
    processor does: any alpha is composited onto white."""
    try:
        image = Image.open(io.BytesIO(data))
        image.load()
    except Exception as exc:  # Pillow raises many types for bad bytes
        raise ImageDecodeError(f"cannot decode image: {exc}") from exc
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")


def preprocess(image: Image.Image, geometry: ImageGeometry, norm: ImageNormalization) -> PreprocessedImage:
    height, width = image.height, image.width
    new_h, new_w = smart_resize(height, width, geometry)
    resized = image.resize((new_w, new_h), resample=Image.Resampling.BICUBIC)
    pixels = (np.asarray(resized, dtype=np.uint8).astype(np.float64) * (1 / 255)).astype(np.float32)
    mean = np.asarray(norm.mean, dtype=np.float32)
    std = np.asarray(norm.std, dtype=np.float32)
    pixels = ((pixels - mean) / std).transpose(2, 0, 1)  # [C, H, W]
    return PreprocessedImage(*_patchify(pixels, geometry))


def _patchify(pixels: np.ndarray, geometry: ImageGeometry) -> tuple[np.ndarray, tuple[int, int, int]]:
    channels, height, width = pixels.shape
    p, m, t = geometry.patch_size, geometry.merge_size, geometry.temporal_patch_size
    grid_h, grid_w = height // p, width // p
    blocks = pixels.reshape(channels, grid_h // m, m, p, grid_w // m, m, p)
    # -> merged row, merged col, row in square, col in square, channel, patch row, patch col
    blocks = blocks.transpose(1, 4, 2, 5, 0, 3, 6)
    blocks = np.broadcast_to(blocks[:, :, :, :, :, None], (*blocks.shape[:5], t, p, p))
    patches = np.ascontiguousarray(blocks).reshape(grid_h * grid_w, channels * t * p * p)
    return patches, (1, grid_h, grid_w)
