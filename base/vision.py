"""Image arithmetic both planes must agree on (no torch, no Pillow): how an image of a given size
becomes a patch grid and a run of placeholder tokens, and where those tokens sit in rotary space.

Qwen-VL processors resize every image so that each side is a multiple of
`factor = patch_size * merge_size` and the pixel count lies in [min_pixels, max_pixels]
(`smart_resize`); the vision tower then sees a grid of `grid_h x grid_w` patches and the merger
folds each `merge x merge` square of patches into one language-model token:

    image 100 x 60 px, patch 16, merge 2  ->  resized 96 x 64  ->  grid 6 x 4 patches
                                          ->  3 x 2 = 6 placeholder tokens

The control plane computes the token count from the image's size (to expand the prompt and hash
the blocks), the worker computes the same grid when it preprocesses the pixels; both call this
module, so the two can never disagree.

M-RoPE (worker/vision/mrope.py): text tokens get the same rotary position on all three axes (t, h, w);
an image's tokens get (start, start + row, start + col) where `start` is the position its run
begins at, and the text after it resumes at start + max(rows, cols). Rotary positions therefore
fall behind KV positions by a per-sequence `shift` after each image: the worker keeps the shift
in its sequence mirror, and a decode token at KV position p rotates by p + shift.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

MAX_ASPECT_RATIO = 200  # the processors refuse more elongated images


class ImageSizeError(ValueError):
    """An image the processor cannot resize (too elongated)."""


@dataclass(frozen=True, slots=True)
class ImageGeometry:
    """How a model's processor turns pixels into patches (the model's preprocessor config)."""

    patch_size: int
    merge_size: int
    temporal_patch_size: int
    min_pixels: int
    max_pixels: int

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size


def smart_resize(height: int, width: int, geometry: ImageGeometry) -> tuple[int, int]:
    """(height, width) the processor resizes an image to: sides multiples of `factor`, aspect
    kept as closely as possible, pixel count within [min_pixels, max_pixels]. Same rounding as
    the Hugging Face Qwen2-VL/Qwen3-VL processors (round half to even on the first guess)."""
    factor = geometry.factor
    if min(height, width) < 1:
        raise ImageSizeError(f"image is {width}x{height} pixels: both sides must be at least 1")
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ImageSizeError(
            f"image is {width}x{height} pixels: the aspect ratio must be at most {MAX_ASPECT_RATIO}"
        )
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > geometry.max_pixels:
        beta = math.sqrt((height * width) / geometry.max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < geometry.min_pixels:
        beta = math.sqrt(geometry.min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def patch_grid(height: int, width: int, geometry: ImageGeometry) -> tuple[int, int, int]:
    """HF's `image_grid_thw` of one image: (1, patch rows, patch columns) after resizing."""
    h, w = smart_resize(height, width, geometry)
    return 1, h // geometry.patch_size, w // geometry.patch_size


def num_image_tokens(grid_thw: tuple[int, int, int], merge_size: int) -> int:
    t, h, w = grid_thw
    return t * h * w // (merge_size * merge_size)


@dataclass(frozen=True, slots=True)
class ImageSpan:
    """Where one image's placeholder run sits in a prompt: KV positions
    [offset, offset + num_tokens), a merged grid of `rows x cols` tokens (t = 1 for images)."""

    offset: int
    rows: int
    cols: int

    @property
    def num_tokens(self) -> int:
        return self.rows * self.cols

    @property
    def end(self) -> int:
        return self.offset + self.num_tokens


def rope_shift(spans: list[ImageSpan]) -> int:
    """Rotary minus KV position of every token after the last image (HF's `rope_deltas`)."""
    shift = 0
    for span in spans:
        shift = span.offset + shift + max(span.rows, span.cols) - span.end
    return shift
