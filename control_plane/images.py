"""A request's images on the control plane (no torch): checked, sized and expanded into their
placeholder tokens before the request is admitted.

    prompt ids  ... <|vision_start|> <|image_pad|> <|vision_end|> ...      (one pad per image)
    expanded    ... <|vision_start|> <|image_pad|> x N <|vision_end|> ...  N = grid / merge^2

N follows from the image's size exactly as the model's processor computes it (base/vision.py),
so the prompt the scheduler hashes and the worker computes is the one Hugging Face's processor
builds. Each image is decoded in full here (Pillow): a corrupt file is this request's
INVALID_ARGUMENT, never a failed step for every running request at the worker.

Limits (engine.proto, GenerateRequest.images), checked cheapest first: count, then bytes, then
the header's size (a 100k x 100k image is refused before any pixel is decoded), then the decode.
"""

from __future__ import annotations

import io
import threading
import warnings
from collections import OrderedDict
from dataclasses import dataclass
from hashlib import blake2b

from base.plan import ModelFacts, PlanImage
from base.vision import MAX_ASPECT_RATIO, ImageGeometry, ImageSizeError, num_image_tokens, patch_grid
from control_plane.errors import InvalidRequestError

MAX_IMAGES = 8
MAX_IMAGE_BYTES = 10 * 1024 * 1024
MAX_IMAGE_PIXELS = 64 * 1024 * 1024  # before resizing; the processor then caps at max_pixels
MIN_IMAGE_SIDE = 2
# A plan carries the bytes of the images its new sequences must encode; the scheduler admits
# image prompts into one plan only up to this much (the worker's message limit is 64 MiB).
MAX_PLAN_IMAGE_BYTES = 24 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class PromptImage:
    """One admitted image: where its tokens sit in the prompt and its content hash, which the
    prefix cache mixes into the hash of every block holding any of its tokens."""

    offset: int
    num_tokens: int
    grid_thw: tuple[int, int, int]
    data: bytes
    content_hash: bytes

    @property
    def end(self) -> int:
        return self.offset + self.num_tokens

    def for_plan(self, start_pos: int) -> PlanImage:
        """Bytes only when some of its tokens are not yet computed (the worker must encode)."""
        return PlanImage(self.offset, self.grid_thw, self.data if self.end > start_pos else b"")


class ImageSizeCache:
    """Content hash -> (width, height) of images already decoded and checked, so the same
    picture sent again (a shared image in many requests, a chat resending its history) is
    hashed, not decoded again (~20 ms for a 448 x 448 PNG). LRU over `capacity` entries;
    thread-safe (the engine decodes on worker threads)."""

    def __init__(self, capacity: int = 1024) -> None:
        self.capacity = capacity
        self._sizes: OrderedDict[bytes, tuple[int, int]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, digest: bytes) -> tuple[int, int] | None:
        with self._lock:
            size = self._sizes.get(digest)
            if size is not None:
                self._sizes.move_to_end(digest)
            return size

    def put(self, digest: bytes, size: tuple[int, int]) -> None:
        with self._lock:
            self._sizes[digest] = size
            self._sizes.move_to_end(digest)
            if len(self._sizes) > self.capacity:
                self._sizes.popitem(last=False)


def image_limits():
    """These limits as ModelInfo.image_limits (engine.proto ImageLimits)."""
    from base.v1 import engine_pb2

    return engine_pb2.ImageLimits(
        max_images=MAX_IMAGES,
        max_image_bytes=MAX_IMAGE_BYTES,
        max_image_pixels=MAX_IMAGE_PIXELS,
        min_image_side=MIN_IMAGE_SIDE,
        max_aspect_ratio=MAX_ASPECT_RATIO,
    )


def check_image_count(images) -> None:
    """Before anything else: the count and the encoded sizes (cheap, no decode)."""
    if len(images) > MAX_IMAGES:
        raise InvalidRequestError(f"at most {MAX_IMAGES} images per request, got {len(images)}")
    for i, data in enumerate(images):
        if not data:
            raise InvalidRequestError(f"image {i} is empty (0 bytes)")
        if len(data) > MAX_IMAGE_BYTES:
            raise InvalidRequestError(
                f"image {i} has {len(data)} bytes; the limit is {MAX_IMAGE_BYTES} bytes per image"
            )


def image_size(index: int, data: bytes) -> tuple[int, int]:
    """(width, height) of a fully decodable image within the pixel limits; InvalidRequestError
    naming the limit otherwise."""
    from PIL import Image  # lazy: text-only servers never load Pillow

    try:
        with warnings.catch_warnings():
            # Our own pixel limit below is lower than Pillow's warning threshold and names ours.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
            width, height = image.size
            if width * height > MAX_IMAGE_PIXELS:
                raise InvalidRequestError(
                    f"image {index} is {width}x{height} pixels; the limit is {MAX_IMAGE_PIXELS} pixels"
                )
            if min(width, height) < MIN_IMAGE_SIDE:
                raise InvalidRequestError(
                    f"image {index} is {width}x{height} pixels; each side must be at least {MIN_IMAGE_SIDE}"
                )
            image.load()  # decode every pixel: truncated or corrupt data fails here
    except InvalidRequestError:
        raise
    except Image.DecompressionBombError as exc:  # Pillow refuses far larger ones on open
        raise InvalidRequestError(f"image {index}: the limit is {MAX_IMAGE_PIXELS} pixels ({exc})") from None
    except Exception as exc:  # Pillow raises many types (OSError, SyntaxError, ValueError, ...)
        raise InvalidRequestError(f"image {index} cannot be decoded ({type(exc).__name__}: {exc})") from exc
    return width, height


def expand_images(
    token_ids: list[int], images, facts: ModelFacts, cache: ImageSizeCache | None = None
) -> tuple[list[int], list[PromptImage]]:
    """Decode and size every image (unless `cache` knows its content hash), and expand each of
    the prompt's image tokens into its run. Blocking (decodes pixels): call it off the event
    loop for large images."""
    if not facts.accepts_images:
        if images:
            raise InvalidRequestError(f"model {facts.model_name!r} takes no images (a text-only model)")
        return token_ids, []
    pad = facts.image_token_id
    markers = [i for i, t in enumerate(token_ids) if t == pad]
    if len(markers) != len(images):
        raise InvalidRequestError(
            f"the prompt has {len(markers)} image placeholders (token {pad}) for {len(images)} images; "
            "put one <|vision_start|><|image_pad|><|vision_end|> where each image goes"
        )
    if not images:
        return token_ids, []
    check_image_count(images)
    geometry = ImageGeometry(  # temporal_patch_size does not change an image's token count
        facts.image_patch_size, facts.image_merge_size, 2, facts.image_min_pixels, facts.image_max_pixels
    )
    expanded: list[int] = []
    prompt_images: list[PromptImage] = []
    previous = 0
    for index, (marker, data) in enumerate(zip(markers, images, strict=True)):
        digest = blake2b(data, digest_size=32, person=b"pagedkv-image").digest()
        size = cache.get(digest) if cache is not None else None
        if size is None:
            size = image_size(index, data)
            if cache is not None:
                cache.put(digest, size)
        width, height = size
        try:
            grid = patch_grid(height, width, geometry)
        except ImageSizeError as exc:
            raise InvalidRequestError(f"image {index}: {exc}") from None
        count = num_image_tokens(grid, geometry.merge_size)
        expanded.extend(token_ids[previous:marker])
        prompt_images.append(PromptImage(len(expanded), count, grid, bytes(data), digest))
        expanded.extend([pad] * count)
        previous = marker + 1
    expanded.extend(token_ids[previous:])
    return expanded, prompt_images
