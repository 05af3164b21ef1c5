"""Content hashes of full KV blocks, chained through the parent block.

    hash(block i) = blake2b-256( hash(block i-1) || extra keys || token ids of block i )

so equal hashes imply equal *prefixes*, not only equal blocks. 256-bit digests make a
collision practically impossible (a 2^-128 birthday bound at astronomically many blocks),
which is why the cache does not keep tokens to re-verify. Python's `hash` is never used:
it is salted per process and only 64 bits wide.

Extra keys (cache salt, adapter id) enter every block, so two tenants with different salts
never share a block even when their tokens agree. A block holding any of an image's placeholder
tokens also takes that image's content hash (vLLM's mm_hash): placeholders are the same id for
every image, so without it two prompts with different pictures would share KV.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from hashlib import blake2b

_ROOT = b"pagedkv-v1-root"
_TOKEN_TYPECODE = "I"  # uint32, native order; stable within a machine's process lifetime
assert array(_TOKEN_TYPECODE).itemsize == 4, "uint32 array typecode must be 4 bytes"


def extra_keys(cache_salt: str = "", adapter_id: str = "") -> bytes:
    """Encode the keys beyond tokens that make KV different. Empty for the common case."""
    if not cache_salt and not adapter_id:
        return b""
    return f"salt={cache_salt}\x00adapter={adapter_id}".encode()


def hash_block(parent: bytes | None, token_ids: list[int], extra: bytes = b"") -> bytes:
    h = blake2b(parent if parent is not None else _ROOT, digest_size=32)
    if extra:
        h.update(extra)
    h.update(array(_TOKEN_TYPECODE, token_ids))
    return h.digest()


def extend_block_hashes(
    hashes: list[bytes],
    token_ids: list[int],
    block_size: int,
    num_full: int,
    extra: bytes = b"",
    images: Sequence = (),
) -> None:
    """Append hashes until `hashes` covers the first `num_full` full blocks of `token_ids`.
    `images`: the prompt's control_plane.images.PromptImage (offset, end, content_hash)."""
    parent = hashes[-1] if hashes else None
    for i in range(len(hashes), num_full):
        start, end = i * block_size, (i + 1) * block_size
        block_extra = extra + image_keys(images, start, end) if images else extra
        parent = hash_block(parent, token_ids[start:end], block_extra)
        hashes.append(parent)


def image_keys(images: Sequence, start: int, end: int) -> bytes:
    """The content hashes of the images with placeholder tokens in [start, end), in order."""
    return b"".join(b"img=" + i.content_hash for i in images if i.offset < end and i.end > start)
