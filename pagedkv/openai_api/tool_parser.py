"""Reading tool calls out of a chat answer, whole or as it streams.

A parser is fed text pieces and returns events: ("content", text) for text the client may
see now, ("call", name, arguments_json) for a complete call. The non-streaming response feeds
the whole text at once, so both paths give the same calls and content.

- Hermes / Qwen: calls are `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks
  anywhere in the text; content is the text outside them. While streaming, text that could
  be the start of `<tool_call>` is held back, and a call is sent once its block is closed
  (one delta with its whole arguments; the SDKs accumulate deltas either way).
- Llama 3: the whole answer is one JSON object `{"name": ..., "parameters": {...}}` (optionally
  after `<|python_tag|>`, several separated by ";"). An answer that starts like one is held to
  its end and parsed; any other answer streams as content.
A block or object that does not parse as a call is returned as content, never dropped.
"""

from __future__ import annotations

import json

from pagedkv.openai_api.tools import LLAMA3_JSON

OPEN, CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"


def _call(obj, args_key: str):
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    if not isinstance(args, dict):
        return None
    return ("call", obj["name"], json.dumps(args, ensure_ascii=False))


class HermesParser:
    def __init__(self) -> None:
        self._buf = ""
        self._in_call = False
        self._lead = ""  # whitespace before the open block: content again if it is not a call

    def feed(self, text: str) -> list[tuple]:
        self._buf += text
        events = []
        while True:
            if self._in_call:
                end = self._buf.find(CLOSE)
                if end < 0:
                    return events
                body, self._buf = self._buf[:end], self._buf[end + len(CLOSE) :]
                self._in_call = False
                try:
                    event = _call(json.loads(body), "arguments")
                except json.JSONDecodeError:
                    event = None
                if event is None:
                    events.append(("content", self._lead + OPEN + body + CLOSE))
                else:
                    events.append(event)
                self._lead = ""
                continue
            start = self._buf.find(OPEN)
            if start >= 0:
                lead = self._buf[:start]
                if lead.strip():
                    events.append(("content", lead))
                else:
                    self._lead = lead
                self._buf = self._buf[start + len(OPEN) :]
                self._in_call = True
                continue
            keep = _partial_suffix(self._buf, OPEN)
            ready = self._buf[: len(self._buf) - keep]
            if ready.strip():  # whitespace alone (between blocks) is held, dropped at the end
                events.append(("content", ready))
                self._buf = self._buf[len(ready) :]
            return events

    def finish(self) -> list[tuple]:
        """The rest: an unclosed block (max_tokens ended it) is content."""
        rest = (self._lead + OPEN if self._in_call else "") + self._buf
        self._buf, self._in_call, self._lead = "", False, ""
        return [("content", rest)] if rest.strip() else []


class Llama3JsonParser:
    def __init__(self) -> None:
        self._buf = ""
        self._holding = True  # until the answer shows it is not a call

    def feed(self, text: str) -> list[tuple]:
        if not self._holding:
            return [("content", text)] if text else []
        self._buf += text
        head = self._buf.lstrip()
        if not head or head.startswith("{") or PYTHON_TAG.startswith(head[: len(PYTHON_TAG)]):
            return []
        self._holding = False
        out, self._buf = self._buf, ""
        return [("content", out)]

    def finish(self) -> list[tuple]:
        if not self._holding or not self._buf:
            return []
        text, self._buf = self._buf, ""
        body = text.strip().removeprefix(PYTHON_TAG).strip()
        events = []
        for part in body.split(";"):
            try:
                event = _call(json.loads(part), "parameters")
            except json.JSONDecodeError:
                event = None
            if event is None:
                return [("content", text)]
            events.append(event)
        return events


def make_parser(fmt: str):
    return Llama3JsonParser() if fmt == LLAMA3_JSON else HermesParser()


def _partial_suffix(text: str, token: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `token`."""
    for n in range(min(len(token) - 1, len(text)), 0, -1):
        if text.endswith(token[:n]):
            return n
    return 0


def parse_whole(fmt: str, text: str) -> tuple[str | None, list[tuple[str, str]]]:
    """(content or None, [(name, arguments json)]) of a finished answer."""
    parser = make_parser(fmt)
    events = parser.feed(text) + parser.finish()
    content = "".join(e[1] for e in events if e[0] == "content")
    calls = [(e[1], e[2]) for e in events if e[0] == "call"]
    return (content.strip() or None) if calls else content, calls
