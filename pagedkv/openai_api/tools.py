"""Tool calling on chat: the request's `tools` checked, `tool_choice` resolved, and for
`required` or a named tool the structured output that makes the model's answer a call.

    tools ──check──▶ [Tool] ──chat template (tools=...)──▶ prompt
    tool_choice: none      tools rendered, the output is plain content
                 auto      tools rendered, the output parsed for calls (tool_parser.py)
                 required  + a grammar: one to four calls to any of the tools
                 named     + a grammar: one call to that tool
The grammar writes calls in the format the parser reads (the model's chat template decides:
Hermes/Qwen `<tool_call>{json}</tool_call>` blocks, or Llama 3's bare JSON object), each call's
arguments constrained by its tool's `parameters` schema, compact JSON (no free whitespace a
weak model could spend its budget on). So a required or named call always parses.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from base.grammar import close_objects
from base.v1 import engine_pb2
from pagedkv.openai_api.errors import bad_request

_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")  # OpenAI's rule for function names
MAX_TOOLS = 128
MAX_PARALLEL_CALLS = 4  # `required`: at most this many calls in one answer
HERMES, LLAMA3_JSON = "hermes", "llama3_json"


@dataclass(frozen=True, slots=True)
class Tool:
    name: str
    parameters: dict
    definition: dict  # as the client sent it (what the chat template renders)


def check_tools(tools: Any) -> list[Tool]:
    """The request's tools, each checked: 400 naming `tools[i]...` otherwise."""
    if not isinstance(tools, list) or not tools:
        raise bad_request("tools must be a non-empty list", "tools")
    if len(tools) > MAX_TOOLS:
        raise bad_request(f"at most {MAX_TOOLS} tools", "tools")
    out, seen = [], set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise bad_request(f"{where} must be {{'type': 'function', 'function': {{...}}}}", f"{where}.type")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise bad_request(f"{where}.function must be an object with a name", f"{where}.function")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise bad_request(
                f"{where}.function.name must be 1-64 of a-z, A-Z, 0-9, '_', '.', '-'; got {name!r}",
                f"{where}.function.name",
            )
        if name in seen:
            raise bad_request(f"{where}.function.name {name!r} is not unique", f"{where}.function.name")
        seen.add(name)
        params = fn.get("parameters", {"type": "object", "properties": {}})
        _check_parameters(params, f"{where}.function.parameters")
        out.append(Tool(name, params, {"type": "function", "function": fn}))
    return out


def _check_parameters(params: Any, param: str) -> None:
    """An object schema the grammar engine accepts (checked here even under `auto`, where no
    grammar is built, so a bad schema is refused whatever tool_choice says)."""
    if not isinstance(params, dict):
        raise bad_request(f"{param} must be a JSON Schema object", param)
    if params.get("type", "object") != "object":
        raise bad_request(f"{param} must describe an object (type: object)", param)
    import llguidance

    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(params))
    except ValueError as exc:
        raise bad_request(f"{param}: {exc}", param) from None
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise bad_request(f"{param} is not a schema the engine accepts: {error.strip()[:300]}", param)


def resolve_choice(tool_choice: Any, tools: list[Tool] | None) -> tuple[str, list[Tool]]:
    """("none" | "auto" | "required" | "named", the tools a call may name)."""
    if tools is None:
        if tool_choice not in (None, "none"):
            raise bad_request("tool_choice needs tools", "tool_choice")
        return "none", []
    if tool_choice is None or tool_choice == "auto":
        return "auto", tools
    if tool_choice in ("none", "required"):
        return tool_choice, tools
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        name = (tool_choice.get("function") or {}).get("name")
        named = [t for t in tools if t.name == name]
        if not named:
            raise bad_request(f"tool_choice names {name!r}, which is not among the tools", "tool_choice")
        return "named", named
    raise bad_request(
        "tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}",
        "tool_choice",
    )


def _call_schema(tools: list[Tool], fmt: str) -> dict:
    key = "parameters" if fmt == LLAMA3_JSON else "arguments"
    options = [
        {
            "type": "object",
            "properties": {"name": {"const": t.name}, key: close_objects(t.parameters)},
            "required": ["name", key],
            "additionalProperties": False,
        }
        for t in tools
    ]
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    return {"x-guidance": {"whitespace_flexible": False}, **schema}


def call_constraint(tools: list[Tool], fmt: str, parallel: bool) -> engine_pb2.StructuredOutput:
    """The grammar for `required` / named: the answer is only calls, in the parser's format."""
    schema = json.dumps(_call_schema(tools, fmt))
    out = engine_pb2.StructuredOutput()
    if fmt == LLAMA3_JSON:
        out.grammar = f"start: %json {schema}"
        return out
    repeat = f'("\\n" call){{0,{MAX_PARALLEL_CALLS - 1}}}' if parallel else ""
    out.grammar = f'start: call {repeat}\ncall: "<tool_call>\\n" %json {schema} "\\n</tool_call>"'
    return out


def parser_format(template_text: str) -> str:
    """Which call format the model was trained on, read from its chat template: Llama 3's
    (`<|python_tag|>`, "ipython") or Hermes/Qwen's `<tool_call>` (the default, and the
    embedded model's template)."""
    if "<tool_call>" in template_text:
        return HERMES
    if "<|python_tag|>" in template_text or "ipython" in template_text:
        return LLAMA3_JSON
    return HERMES


@dataclass(frozen=True, slots=True)
class ToolCalling:
    """What a chat request's tools mean for its prompt, sampling and response."""

    definitions: list[dict] | None  # rendered by the chat template (None: no tools)
    constraint: engine_pb2.StructuredOutput | None  # required / named: the call grammar
    parse_format: str | None  # the answer is parsed for calls in this format (None: it is not)

    @classmethod
    def of(cls, body, template_text: str) -> ToolCalling:
        from pagedkv.openai_api.structured import structured_output

        tools = check_tools(body.tools) if body.tools is not None else None
        mode, callable_tools = resolve_choice(body.tool_choice, tools)
        if tools is None:
            return cls(None, None, None)
        fmt = parser_format(template_text)
        definitions = [t.definition for t in tools]
        if mode == "none":
            return cls(definitions, None, None)
        if mode == "auto":
            return cls(definitions, None, fmt)
        if structured_output(body) is not None:
            raise bad_request(
                f"tool_choice {mode} constrains the answer to calls; it cannot be combined with "
                "response_format or guided_* fields",
                "tool_choice",
            )
        parallel = mode == "required" and body.parallel_tool_calls is not False
        return cls(definitions, call_constraint(callable_tools, fmt, parallel), fmt)
