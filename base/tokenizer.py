"""Text <-> token ids on the control plane (no torch).

The worker owns the checkpoint; it ships its tokenizer to the control plane in `Describe`
(`WorkerInfo.tokenizer_kind` / `tokenizer_json`), so the control plane never needs the
model directory. Two kinds:
  - "byte": the embedded default model's byte-level tokenizer (ids 0..255 are bytes);
  - "hf":   a Hugging Face `tokenizer.json`, through the `tokenizers` library.

`token_bytes(id)` is what one token stands for in the middle of a text: concatenated over a
sequence's ids it gives the UTF-8 of `decode(ids)`, except for decoder steps that act on the
whole text (SentencePiece's removal of the first leading space). A token that holds part of
a multi-byte character has bytes that are not valid UTF-8 on their own (`token_display`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Protocol


class Tokenizer(Protocol):
    vocab_size: int

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]: ...

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str: ...

    def token_bytes(self, token_id: int) -> bytes: ...

    def is_special(self, token_id: int) -> bool: ...


def token_display(piece: bytes) -> str:
    """A token's bytes as text: the text itself when valid UTF-8, else "bytes:\\xe2\\x82"
    (vLLM's and OpenAI's form), so two partial-character tokens never show the same string."""
    try:
        return piece.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in piece)


class ByteTokenizer:
    """UTF-8 bytes as tokens; ids >= 256 are special tokens, shown by name ("<|bos|>") and
    left out of `decode` unless skip_special_tokens=False."""

    BOS = 256
    EOS = 257

    def __init__(self, vocab_size: int = 512) -> None:
        if vocab_size < 258:
            raise ValueError(f"a byte tokenizer needs a vocab of at least 258, got {vocab_size}")
        self.vocab_size = vocab_size

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        # Its "post-processor": the BOS the model declares, as Llama-style tokenizers add.
        ids = list(text.encode("utf-8"))
        return [self.BOS, *ids] if add_special_tokens else ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        if skip_special_tokens:
            data = bytes(t for t in token_ids if t < 256)
        else:
            data = b"".join(self.token_bytes(t) for t in token_ids)
        return data.decode("utf-8", errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        if token_id < 256:
            return bytes((token_id,))
        name = {self.BOS: "bos", self.EOS: "eos"}.get(token_id, f"special_{token_id}")
        return f"<|{name}|>".encode()

    def is_special(self, token_id: int) -> bool:
        return token_id >= 256


def _gpt2_byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: the printable char that stands for each byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)]
    table = {b: chr(b) for b in printable}
    extra = (b for b in range(256) if b not in table)
    table.update({b: chr(256 + n) for n, b in enumerate(extra)})
    return {c: b for b, c in table.items()}


_GPT2_BYTES = _gpt2_byte_decoder()
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_Step = Callable[[str | bytes], str | bytes]  # a decoder step on one token: str -> str or bytes


def _byte_level(piece: str | bytes) -> str | bytes:
    if isinstance(piece, bytes) or any(c not in _GPT2_BYTES for c in piece):
        return piece  # as tokenizers does: a piece outside the alphabet stays its own UTF-8
    return bytes(_GPT2_BYTES[c] for c in piece)


def _byte_fallback(piece: str | bytes) -> str | bytes:
    m = _BYTE_FALLBACK.fullmatch(piece) if isinstance(piece, str) else None
    return bytes((int(m.group(1), 16),)) if m else piece


def _replace(old: str, new: str) -> _Step:
    return lambda piece: piece.replace(old, new) if isinstance(piece, str) else piece


def _decoder_steps(decoder: dict | None) -> list[_Step] | None:
    """tokenizer.json's "decoder" as per-token steps; None when one is not understood.
    Fuse and Strip act on the joined text, not on a token: they have no per-token step."""
    kind = (decoder or {}).get("type")
    if kind == "Sequence":
        steps = [_decoder_steps(d) for d in decoder["decoders"]]
        return None if None in steps else [s for group in steps for s in group]
    if kind == "ByteLevel":
        return [_byte_level]
    if kind == "ByteFallback":
        return [_byte_fallback]
    if kind == "Metaspace":
        return [_replace(decoder.get("replacement", "\u2581"), " ")]
    if kind == "Replace" and "String" in decoder.get("pattern", {}):
        return [_replace(decoder["pattern"]["String"], decoder["content"])]
    if kind in ("Fuse", "Strip"):
        return []
    return None


class HFTokenizer:
    """A tokenizer.json through the `tokenizers` library. `token_bytes` follows the file's
    decoder (ByteLevel, ByteFallback, Metaspace, Replace of a string); under any other it
    falls back to `decode([id])`. Added tokens stand for their content's UTF-8."""

    def __init__(self, tokenizer_json: str) -> None:
        from tokenizers import Tokenizer as _HF  # imported lazily: optional dependency

        self._tok = _HF.from_str(tokenizer_json)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        spec = json.loads(tokenizer_json)
        self._added = {t["id"]: t["content"].encode() for t in spec.get("added_tokens") or ()}
        self._special = frozenset(t["id"] for t in spec.get("added_tokens") or () if t.get("special"))
        self._steps = _decoder_steps(spec.get("decoder"))
        # Filled lazily: vocabularies reach 256k ids and a request names few. Threads may race
        # on a fill; both compute the same value.
        self._bytes: dict[int, bytes] = {}

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """b"" for an id with no token (a model's vocab may be padded past the tokenizer's)."""
        cached = self._bytes.get(token_id)
        if cached is None:
            cached = self._bytes[token_id] = self._compute_bytes(token_id)
        return cached

    def _compute_bytes(self, token_id: int) -> bytes:
        if token_id in self._added:
            return self._added[token_id]
        piece = self._tok.id_to_token(token_id)
        if piece is None:
            return b""
        if self._steps is None:
            return self._tok.decode([token_id], skip_special_tokens=False).encode()
        for step in self._steps:
            piece = step(piece)
        return piece if isinstance(piece, bytes) else piece.encode()

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special


def make_tokenizer(kind: str, tokenizer_json: str = "", vocab_size: int = 512) -> Tokenizer | None:
    if kind == "byte":
        return ByteTokenizer(vocab_size)
    if kind == "hf":
        return HFTokenizer(tokenizer_json)
    if kind in ("", "none"):
        return None
    raise ValueError(f"unknown tokenizer kind {kind!r} (expected 'byte', 'hf' or 'none')")


class IncrementalDetokenizer:
    """UTF-8-safe streaming text: emits only text whose bytes are complete.

    Decodes a sliding window of recent tokens and holds back a trailing U+FFFD (an
    incomplete multi-byte character) until the next token completes it.
    """

    __slots__ = ("_tok", "_ids", "_emitted_upto", "_prefix_len")

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tok = tokenizer
        self._ids: list[int] = []
        self._prefix_len = 0  # ids[:_prefix_len] are fully emitted
        self._emitted_upto = 0  # chars of decode(ids[_prefix_len:]) already emitted

    def add(self, token_ids: list[int]) -> str:
        self._ids.extend(token_ids)
        text = self._tok.decode(self._ids[self._prefix_len :])
        if text.endswith("\ufffd"):
            return ""
        new = text[self._emitted_upto :]
        # Re-anchor the window so decode cost stays O(window), not O(sequence).
        self._prefix_len = max(self._prefix_len, len(self._ids) - 4)
        self._emitted_upto = len(self._tok.decode(self._ids[self._prefix_len :]))
        return new

    def flush(self) -> str:
        """The held-back tail, when the sample ends: an incomplete character is final now."""
        text = self._tok.decode(self._ids[self._prefix_len :])
        new = text[self._emitted_upto :]
        self._emitted_upto = len(text)
        return new
