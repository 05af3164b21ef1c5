"""Image content parts of chat messages: OpenAI's `{"type": "image_url", "image_url": {"url":
...}}` (also the bare-string form `"image_url": "..."`).

Only inline `data:` URLs are accepted (`data:image/png;base64,...`): the front never fetches a
remote URL for a caller (a server that fetches arbitrary URLs can be made to probe its own
network), so http(s) URLs are a 400 that says how to send the image instead. The bytes go to
the engine untouched; it decodes and checks them (limits: engine.proto GenerateRequest.images).
"""

from __future__ import annotations

import base64
import binascii

from pagedkv.openai_api.errors import bad_request

IMAGE_PART_TYPES = ("image_url", "image")
MAX_IMAGES = 8  # the engine's limit too; refused here before decoding any base64


def is_image_part(part: dict) -> bool:
    return part.get("type") in IMAGE_PART_TYPES


def image_bytes(part: dict, index: int) -> bytes:
    """The encoded image of one content part (400 for anything but a base64 data URL)."""
    ref = part.get("image_url", part.get("image"))
    url = ref.get("url") if isinstance(ref, dict) else ref
    param = "messages.content.image_url"
    if not isinstance(url, str) or not url:
        raise bad_request(f"image part {index} has no image_url.url", param)
    if url.startswith(("http://", "https://")):
        raise bad_request(
            f"image {index}: remote image URLs are not fetched by this server; send the image inline "
            "as a data URL (data:image/png;base64,...)",
            param,
        )
    if not url.startswith("data:"):
        raise bad_request(f"image {index}: only data: URLs are accepted (data:image/png;base64,...)", param)
    header, _, payload = url.partition(",")
    if not header.endswith(";base64"):
        raise bad_request(f"image {index}: the data URL must be base64 (data:<mime>;base64,<data>)", param)
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise bad_request(f"image {index}: the data URL's base64 does not decode", param) from None
