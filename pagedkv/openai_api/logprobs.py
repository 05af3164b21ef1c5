"""Logprobs in OpenAI's shapes: each token shown as its own text, with its own bytes.

The Engine sends token ids and float logprobs only; how a token looks comes from its
`Detokenize` (each id's bytes), fetched once per id and cached (`TokenTexts`). A token's
`token` string is its bytes as UTF-8 when they are valid UTF-8, else `bytes:\\xe6\\x97`
(base.tokenizer.token_display): a token holding part of a character never shows as "" or
"\ufffd", so two alternatives never collide as keys of a completions `top_logprobs` dict.
`bytes` is the token's own bytes (not its display's). With `return_tokens_as_token_ids` (a
vLLM extra), and for a model served without a tokenizer, tokens show as `token_id:N`.

Logprobs are the model's raw distribution (log-softmax of the logits before temperature,
penalties and truncation: vLLM's `raw_logprobs`); -inf is sent as -9999.0, as OpenAI does.
Completions' `top_logprobs` hold the k alternatives plus the chosen token (vLLM's shape:
lm-eval decides "greedy" by comparing a token's logprob with the dict's maximum).
"""

from __future__ import annotations

import codecs
from collections.abc import Iterable
from dataclasses import dataclass

from base.tokenizer import token_display
from base.v1 import engine_pb2
from pagedkv.client import AsyncClient, ClientError
from pagedkv.openai_api.errors import from_client_error

LOGPROB_FLOOR = -9999.0  # OpenAI's stand-in for "impossible" (JSON has no -inf)
_FETCH_LIMIT = 65536  # ids per Detokenize call (the Engine takes up to 262144)


class TokenTexts:
    """token id -> (display text, bytes), from the Engine's tokenizer, cached for the life of
    one served model (the Front makes a new one when the worker's instance changes)."""

    def __init__(self, client: AsyncClient, has_tokenizer: bool, as_ids: bool = False) -> None:
        self._client = client
        self._has_tokenizer = has_tokenizer
        self._as_ids = as_ids
        self._pieces: dict[int, bytes] = {}
        self._special: set[int] = set()

    def with_ids(self) -> TokenTexts:
        """The same cache, tokens shown as `token_id:N` (return_tokens_as_token_ids)."""
        view = TokenTexts(self._client, self._has_tokenizer, as_ids=True)
        view._pieces, view._special = self._pieces, self._special
        return view

    async def fetch(self, ids: Iterable[int]) -> None:
        """Makes every id in `ids` known (one Detokenize for those not cached yet)."""
        if not self._has_tokenizer:
            return
        missing = sorted({t for t in ids if t not in self._pieces})
        for i in range(0, len(missing), _FETCH_LIMIT):
            part = missing[i : i + _FETCH_LIMIT]
            try:
                reply = await self._client.detokenize(part, timeout=30.0)
            except ClientError as e:
                raise from_client_error(e) from None
            for token, piece, special in zip(part, reply.token_bytes, reply.special, strict=True):
                self._pieces[token] = piece
                if special:
                    self._special.add(token)

    def display(self, token: int) -> str:
        if self._as_ids or not self._has_tokenizer:
            return f"token_id:{token}"
        return token_display(self._pieces[token])

    def raw(self, token: int) -> bytes:
        if not self._has_tokenizer:
            return self.display(token).encode()
        return self._pieces[token]

    def in_text(self, token: int) -> bytes:
        """What the token adds to the response text (special tokens are left out of it)."""
        return b"" if token in self._special else self.raw(token)


def _lp(value: float | None) -> float | None:
    return None if value is None else max(value, LOGPROB_FLOOR)


def _alternatives(top: tuple[list[int], list[float]] | None, k: int) -> list[tuple[int, float]]:
    """The k most likely (id, logprob) of a position, best first."""
    return list(zip(top[0], top[1], strict=True))[:k] if top else []


@dataclass
class TokenLogprobs:
    """Per token of a stretch of text (a prompt or generated tokens): id, logprob (None where
    there is none: a prompt's first token, or a worker that sent none) and alternatives."""

    ids: list[int]
    logprobs: list[float | None]
    tops: list[tuple[list[int], list[float]] | None]

    @classmethod
    def empty(cls) -> TokenLogprobs:
        return cls([], [], [])

    def extend_generated(self, msg: engine_pb2.GenerateResponse) -> None:
        n = len(msg.token_ids)
        self.ids.extend(msg.token_ids)
        self.logprobs.extend(list(msg.logprobs) + [None] * (n - len(msg.logprobs)))
        tops = [(list(t.token_ids), list(t.logprobs)) for t in msg.top_logprobs]
        self.tops.extend(tops + [None] * (n - len(tops)))

    @classmethod
    def of_prompt(cls, entries) -> TokenLogprobs:
        out = cls.empty()
        for e in entries:
            out.ids.append(e.token_id)
            out.logprobs.append(e.logprob if e.HasField("logprob") else None)
            out.tops.append((list(e.top.token_ids), list(e.top.logprobs)) if e.HasField("logprob") else None)
        return out

    def all_ids(self) -> set[int]:
        ids = set(self.ids)
        for top in self.tops:
            if top is not None:
                ids.update(top[0])
        return ids


class TextOffsets:
    """Character offsets of tokens in the text they make: a token starts where the characters
    completed before it end (a character split across tokens counts once it is whole)."""

    def __init__(self, start: int = 0) -> None:
        self._chars = start
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def advance(self, piece: bytes) -> int:
        offset = self._chars
        self._chars += len(self._decoder.decode(piece))
        return offset


def completion_logprobs(texts: TokenTexts, tokens: TokenLogprobs, k: int, offsets: TextOffsets) -> dict:
    """/v1/completions `logprobs`: tokens, token_logprobs, top_logprobs (k alternatives and the
    chosen token; None where a position has none), text_offset."""
    shown, tops, at = [], [], []
    for token, lp, top in zip(tokens.ids, tokens.logprobs, tokens.tops, strict=True):
        shown.append(texts.display(token))
        at.append(offsets.advance(texts.in_text(token)))
        if lp is None:
            tops.append(None)
            continue
        entry = {texts.display(t): _lp(v) for t, v in _alternatives(top, k)}
        entry.setdefault(texts.display(token), _lp(lp))
        tops.append(entry)
    return {
        "tokens": shown,
        "token_logprobs": [_lp(lp) for lp in tokens.logprobs],
        "top_logprobs": tops,
        "text_offset": at,
    }


def _chat_entry(texts: TokenTexts, token: int, lp: float | None) -> dict:
    return {"token": texts.display(token), "logprob": _lp(lp), "bytes": list(texts.raw(token))}


def chat_logprobs(texts: TokenTexts, tokens: TokenLogprobs, k: int) -> dict:
    """Chat `logprobs.content`: per token its text, logprob, bytes and k alternatives."""
    content = []
    for token, lp, top in zip(tokens.ids, tokens.logprobs, tokens.tops, strict=True):
        entry = _chat_entry(texts, token, lp)
        entry["top_logprobs"] = [_chat_entry(texts, t, v) for t, v in _alternatives(top, k)]
        content.append(entry)
    return {"content": content}


def prompt_logprobs(texts: TokenTexts, tokens: TokenLogprobs, k: int) -> list:
    """vLLM's `prompt_logprobs` extra: per prompt position None (the first) or {token id:
    {logprob, rank, decoded_token}} for the prompt token and its k alternatives. rank is the
    position among the alternatives (1 = most likely); null for a prompt token outside them."""
    out: list = []
    for token, lp, top in zip(tokens.ids, tokens.logprobs, tokens.tops, strict=True):
        if lp is None:
            out.append(None)
            continue
        ids = top[0] if top else []
        entry = {
            str(t): {"logprob": _lp(v), "rank": r + 1, "decoded_token": texts.display(t)}
            for r, (t, v) in enumerate(_alternatives(top, k))
        }
        if str(token) not in entry:
            rank = ids.index(token) + 1 if token in ids else None
            entry[str(token)] = {"logprob": _lp(lp), "rank": rank, "decoded_token": texts.display(token)}
        out.append(entry)
    return out
