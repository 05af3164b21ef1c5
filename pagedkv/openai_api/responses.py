"""Response bodies and stream chunks in OpenAI's shapes, built from the Engine's messages.

finish_reason: "stop" (EOS, a stop token id or a stop string) and "length" are OpenAI's;
"abort" (the request was aborted through the gRPC API), "out_of_memory" (the KV pool could
not hold the sample even alone) and "error" are the Engine's own reasons, passed on as vLLM
passes "abort" rather than disguised as one of OpenAI's.
"""

from __future__ import annotations

import time

from base.v1 import engine_pb2
from pagedkv.openai_api.generation import ChoiceOutput, token_texts

_FINISH = {
    engine_pb2.FINISH_REASON_STOP: "stop",
    engine_pb2.FINISH_REASON_LENGTH: "length",
    engine_pb2.FINISH_REASON_ABORT: "abort",
    engine_pb2.FINISH_REASON_OUT_OF_MEMORY: "out_of_memory",
    engine_pb2.FINISH_REASON_ERROR: "error",
}


def finish_reason(code: int) -> str | None:
    return _FINISH.get(code) if code else None


class Envelope:
    """What every body and chunk of one response repeats: id, object, created, model."""

    def __init__(self, response_id: str, obj: str, model: str) -> None:
        self.fields = {"id": response_id, "object": obj, "created": int(time.time()), "model": model}

    def body(self, choices: list, **extra) -> dict:
        return {**self.fields, "choices": choices, **extra}


# -- logprobs --------------------------------------------------------------------------------
def _pairs(texts: list[str], logprobs: list[float]) -> list[tuple[str, float | None]]:
    """(token text, logprob); None where the worker sent none (a worker without logprobs,
    e.g. the test SimWorker): every token is still listed."""
    return [(t, logprobs[i] if i < len(logprobs) else None) for i, t in enumerate(texts)]


def completion_logprobs(texts: list[str], logprobs: list[float], top: int, offset: int = 0) -> dict:
    """/v1/completions `logprobs`: tokens, token_logprobs, text_offset, and top_logprobs when 1
    alternative was asked (the sampled token, the most likely one at temperature 0)."""
    pairs = _pairs(texts, logprobs)
    offsets = []
    for text in texts:
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": texts,
        "token_logprobs": [lp for _, lp in pairs],
        "top_logprobs": [{t: lp} for t, lp in pairs] if top else None,
        "text_offset": offsets,
    }


def chat_logprobs(texts: list[str], logprobs: list[float], top: int) -> dict:
    content = []
    for text, lp in _pairs(texts, logprobs):
        entry = {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}
        entry["top_logprobs"] = [dict(entry)] if top else []
        content.append(entry)
    return {"content": content}


# -- whole responses -------------------------------------------------------------------------
def completion_choice(c: ChoiceOutput, want_logprobs: bool, top: int) -> dict:
    lp = completion_logprobs(c.token_texts, c.logprobs, top) if want_logprobs else None
    return {"index": c.index, "text": c.text, "logprobs": lp, "finish_reason": finish_reason(c.finish_reason)}


def chat_choice(c: ChoiceOutput, want_logprobs: bool, top: int) -> dict:
    return {
        "index": c.index,
        "message": {"role": "assistant", "content": c.text},
        "logprobs": chat_logprobs(c.token_texts, c.logprobs, top) if want_logprobs else None,
        "finish_reason": finish_reason(c.finish_reason),
    }


# -- stream chunks ---------------------------------------------------------------------------
class ChunkMaker:
    """Turns one Engine message into the chunk's choice entry (None: nothing to send), keeping
    per-choice state (text offsets for logprobs, the chat role sent once)."""

    def __init__(self, chat: bool, want_logprobs: bool, top: int) -> None:
        self.chat = chat
        self.want_logprobs = want_logprobs
        self.top = top
        self._offsets: dict[int, int] = {}

    def role_chunk(self, index: int) -> dict:
        return {
            "index": index,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }

    def choice(self, index: int, msg: engine_pb2.GenerateResponse) -> dict | None:
        finish = finish_reason(msg.finish_reason)
        has_tokens = self.want_logprobs and len(msg.token_ids) > 0
        if not msg.text and finish is None and not has_tokens:
            return None
        lp = None
        if self.want_logprobs:
            texts = token_texts(msg)
            if self.chat:
                lp = chat_logprobs(texts, list(msg.logprobs), self.top)
            else:
                offset = self._offsets.get(index, 0)
                lp = completion_logprobs(texts, list(msg.logprobs), self.top, offset)
                self._offsets[index] = offset + len(msg.text)
        if self.chat:
            delta = {"content": msg.text} if msg.text else {}
            return {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish}
        return {"index": index, "text": msg.text, "logprobs": lp, "finish_reason": finish}
