"""Text <-> token ids on the control plane (no torch).

The worker owns the checkpoint; it ships its tokenizer to the control plane in `Describe`
(`WorkerInfo.tokenizer_kind` / `tokenizer_json`), so the control plane never needs the
model directory. Two kinds:
  - "byte": the embedded default model's byte-level tokenizer (ids 0..255 are bytes);
  - "hf":   a Hugging Face `tokenizer.json`, through the `tokenizers` library.
"""

from __future__ import annotations

from typing import Protocol


class Tokenizer(Protocol):
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, token_ids: list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens; ids >= 256 are special tokens that decode to nothing."""

    BOS = 256
    EOS = 257

    def __init__(self, vocab_size: int = 512) -> None:
        if vocab_size < 258:
            raise ValueError(f"a byte tokenizer needs a vocab of at least 258, got {vocab_size}")
        self.vocab_size = vocab_size

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, token_ids: list[int]) -> str:
        return bytes(t for t in token_ids if t < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    def __init__(self, tokenizer_json: str) -> None:
        from tokenizers import Tokenizer as _HF  # imported lazily: optional dependency

        self._tok = _HF.from_str(tokenizer_json)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, token_ids: list[int]) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=True)


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
