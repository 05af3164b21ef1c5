"""Response bodies and stream chunks in OpenAI's shapes, built from the Engine's messages.

finish_reason: "stop" (EOS, a stop token id or a stop string) and "length" are OpenAI's;
"abort" (the request was aborted through the gRPC API), "out_of_memory" (the KV pool could
not hold the sample even alone) and "error" are the Engine's own reasons, passed on as vLLM
passes "abort" rather than disguised as one of OpenAI's.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

from base.v1 import engine_pb2
from pagedkv.openai_api.generation import ChoiceOutput
from pagedkv.openai_api.logprobs import (
    TextOffsets,
    TokenLogprobs,
    TokenTexts,
    chat_logprobs,
    completion_logprobs,
    prompt_logprobs,
)
from pagedkv.openai_api.tool_parser import make_parser, parse_whole

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


@dataclass
class View:
    """How one request's outputs are shown: which endpoint's shapes, logprobs (None = off, k =
    alternatives per token), echo of the prompt (its text per prompt index), prompt logprobs."""

    chat: bool
    texts: TokenTexts
    top: int | None = None
    echo_texts: list[str] | None = None  # completions with echo
    prompt_only: bool = False  # echo with max_tokens 0: nothing generated is shown
    prompt_k: int | None = None  # vLLM's prompt_logprobs extra
    tool_format: str | None = None  # chat with tools: the call format parsed (tool_parser.py)

    def token_ids(self, choices: list[ChoiceOutput]) -> set[int]:
        """Every id whose text a response shows (to fetch them all at once)."""
        ids: set[int] = set()
        for c in choices:
            if self.top is not None:
                ids |= c.generated.all_ids()
            if c.prompt is not None:
                ids |= c.prompt.all_ids()
        return ids

    def _completion_logprobs(self, c: ChoiceOutput, offsets: TextOffsets, first: bool) -> dict | None:
        if self.top is None:
            return None
        tokens = TokenLogprobs.empty()
        if self.echo_texts is not None and first and c.prompt is not None:
            tokens = TokenLogprobs(list(c.prompt.ids), list(c.prompt.logprobs), list(c.prompt.tops))
        if not self.prompt_only:
            tokens.ids += c.generated.ids
            tokens.logprobs += c.generated.logprobs
            tokens.tops += c.generated.tops
        return completion_logprobs(self.texts, tokens, self.top, offsets)

    def completion_choice(self, c: ChoiceOutput, offsets: TextOffsets, first: bool = True) -> dict:
        """A completions choice, or a stream chunk's (`first`: the choice's first chunk)."""
        text = "" if self.prompt_only else c.text
        if self.echo_texts is not None and first:
            text = self.echo_texts[c.prompt_index] + text
        out = {
            "index": c.index,
            "text": text,
            "logprobs": self._completion_logprobs(c, offsets, first),
            "finish_reason": self.finish(c),
        }
        if self.prompt_k is not None and first and c.prompt is not None:
            out["prompt_logprobs"] = prompt_logprobs(self.texts, c.prompt, self.prompt_k)
        return out

    def chat_choice(self, c: ChoiceOutput) -> dict:
        lp = chat_logprobs(self.texts, c.generated, self.top) if self.top is not None else None
        message = {"role": "assistant", "content": c.text}
        finish = self.finish(c)
        if self.tool_format is not None:
            content, calls = parse_whole(self.tool_format, c.text)
            message["content"] = content
            if calls:
                message["tool_calls"] = [_tool_call(name, args) for name, args in calls]
                finish = "tool_calls" if finish == "stop" else finish
        return {"index": c.index, "message": message, "logprobs": lp, "finish_reason": finish}

    def finish(self, c: ChoiceOutput) -> str | None:
        if self.prompt_only and c.finish_reason:
            return "length"  # the one token the Engine made is not shown: max_tokens 0 reached
        return finish_reason(c.finish_reason)

    def body(self, envelope: Envelope, choices: list[ChoiceOutput], usage: dict) -> dict:
        """A whole (non-streaming) response."""
        if not self.chat:
            return envelope.body([self.completion_choice(c, TextOffsets()) for c in choices], usage=usage)
        extra = {}
        if self.prompt_k is not None and choices and choices[0].prompt is not None:
            extra["prompt_logprobs"] = prompt_logprobs(self.texts, choices[0].prompt, self.prompt_k)
        return envelope.body([self.chat_choice(c) for c in choices], usage=usage, **extra)


# -- stream chunks ---------------------------------------------------------------------------
class ChunkMaker:
    """Turns one Engine message into the chunk's choice entry (None: nothing to send), keeping
    per-choice state (text offsets for logprobs, whether its first chunk went out)."""

    def __init__(self, view: View) -> None:
        self.view = view
        self._offsets: dict[int, TextOffsets] = {}
        self._parsers: dict = {}  # chat with tools: per choice, its streaming tool-call parser
        self._num_calls: dict[int, int] = {}

    def role_chunk(self, index: int) -> dict:
        return {
            "index": index,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }

    async def choice(self, index: int, prompt: int, msg: engine_pb2.GenerateResponse) -> dict | None:
        view = self.view
        first = index not in self._offsets
        offsets = self._offsets.setdefault(index, TextOffsets())
        part = ChoiceOutput(index, prompt)
        part.add(msg)
        if view.prompt_only:
            part.text, part.generated = "", TokenLogprobs.empty()
        await view.texts.fetch(view.token_ids([part]))
        has_tokens = view.top is not None and len(part.generated.ids) > 0
        echoes = first and (view.echo_texts is not None or view.prompt_k is not None)
        if not part.text and not part.finish_reason and not has_tokens and not echoes:
            del self._offsets[index]  # nothing sent yet: the next message is still the first
            return None
        if not view.chat:
            return view.completion_choice(part, offsets, first)
        lp = chat_logprobs(view.texts, part.generated, view.top) if view.top is not None else None
        delta = {"content": part.text} if part.text else {}
        finish = view.finish(part)
        if view.tool_format is not None:
            delta, finish = self._tool_delta(index, part.text, finish)
            if not delta and finish is None and lp is None and not first:
                return None
        out = {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish}
        if view.prompt_k is not None and first and part.prompt is not None:
            out["prompt_logprobs"] = prompt_logprobs(view.texts, part.prompt, view.prompt_k)
        return out

    def _tool_delta(self, index: int, text: str, finish: str | None) -> tuple[dict, str | None]:
        """The chunk's delta with tool calls parsed out: content the parser released, and the
        calls completed by this text (each whole, with its own index, as one delta)."""
        parser = self._parsers.get(index)
        if parser is None:
            parser = self._parsers[index] = make_parser(self.view.tool_format)
        events = parser.feed(text) if text else []
        if finish is not None:
            events += parser.finish()
        content = "".join(e[1] for e in events if e[0] == "content")
        delta: dict = {"content": content} if content else {}
        calls = []
        for event in events:
            if event[0] == "call":
                k = self._num_calls.get(index, 0)
                self._num_calls[index] = k + 1
                calls.append({"index": k, **_tool_call(event[1], event[2])})
        if calls:
            delta["tool_calls"] = calls
        if finish == "stop" and self._num_calls.get(index):
            finish = "tool_calls"
        return delta, finish


def _tool_call(name: str, arguments: str) -> dict:
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }
