"""Tool calling through the real openai SDK on the embedded default model (random weights:
under `required` or a named tool_choice every answer is a call only because the call grammar
constrained it), and the call parsers fed text whole and a character at a time."""

from __future__ import annotations

import json

import jsonschema
import pytest

from pagedkv.openai_api.chat_template import default_template
from pagedkv.openai_api.tool_parser import make_parser, parse_whole

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
ADD = {
    "type": "object",
    "properties": {"a": {"type": "integer", "minimum": -99, "maximum": 99}, "b": {"type": "integer"}},
    "required": ["a"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER},
    },
    {"type": "function", "function": {"name": "add", "parameters": ADD}},
]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def _calls_of_stream(chunks):
    calls, content, finish = {}, "", None
    for chunk in chunks:
        for c in chunk.choices:
            content += c.delta.content or ""
            for call in c.delta.tool_calls or ():
                entry = calls.setdefault(call.index, {"name": "", "arguments": ""})
                entry["name"] += call.function.name or ""
                entry["arguments"] += call.function.arguments or ""
            finish = c.finish_reason or finish
    return [calls[k] for k in sorted(calls)], content, finish


def _answer(client, model, stream, **kw):
    if stream:
        return _calls_of_stream(client.chat.completions.create(model=model, stream=True, **kw))
    choice = client.chat.completions.create(model=model, **kw).choices[0]
    calls = [
        {"name": c.function.name, "arguments": c.function.arguments} for c in choice.message.tool_calls or ()
    ]
    return calls, choice.message.content, choice.finish_reason


@pytest.mark.parametrize("stream", [False, True])
def test_required_and_named_choices_always_give_valid_calls(real, stream):
    client = real.sdk()
    for seed in range(4):  # up to 4 calls of up to ~100 bytes each: max_tokens 1000 always fits
        for choice in ("required", {"type": "function", "function": {"name": "add"}}):
            calls, content, finish = _answer(
                client,
                real.model,
                stream,
                messages=ASK,
                tools=TOOLS,
                tool_choice=choice,
                seed=seed,
                max_tokens=1000,
            )
            assert finish == "tool_calls" and calls and not content, (calls, content, finish)
            if choice != "required":
                assert len(calls) == 1 and calls[0]["name"] == "add"
            for call in calls:
                jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])


@pytest.mark.parametrize("stream", [False, True])
def test_auto_renders_the_tools_and_parses_the_answer(real, stream):
    client = real.sdk()
    without = client.chat.completions.create(model=real.model, messages=ASK, max_tokens=1).usage.prompt_tokens
    done = client.chat.completions.create(model=real.model, messages=ASK, tools=TOOLS, max_tokens=1)
    assert done.usage.prompt_tokens > without + 100, "the tools were not rendered into the prompt"
    calls, content, finish = _answer(
        client, real.model, stream, messages=ASK, tools=TOOLS, seed=1, max_tokens=24
    )
    assert finish in ("stop", "length", "tool_calls")
    assert calls or content  # random weights: noise as content, or a call that parsed


def test_a_conversation_with_calls_and_results_renders():
    messages = [
        {"role": "system", "content": "Be brief."},
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
         "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "21"},
    ]  # fmt: skip
    text = default_template().render(messages, tools=[t for t in TOOLS])
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools")
    call = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
    assert f"<tool_call>\n{call}\n</tool_call>" in text
    assert "<tool_response>\n21\n</tool_response>" in text and text.endswith("<|im_start|>assistant\n")
    assert default_template().render(ASK) == "<|im_start|>user\nWhat is the weather in Paris?<|im_end|>\n" \
        "<|im_start|>assistant\n"  # fmt: skip


HERMES_TEXT = 'Sure.\n<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>\n<tool_call>\n' \
    '{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'  # fmt: skip


@pytest.mark.parametrize(
    "fmt, text, content, calls",
    [
        ("hermes", HERMES_TEXT, "Sure.", [("add", {"a": 1}), ("get_weather", {"city": "Oslo"})]),
        ("hermes", "no calls <tool_c", "no calls <tool_c", []),
        ("hermes", "<tool_call>{broken</tool_call> x", "<tool_call>{broken</tool_call> x", []),
        ("hermes", "cut <tool_call>\n{\"name\": \"add\"", "cut <tool_call>\n{\"name\": \"add\"", []),
        ("llama3_json", '{"name": "add", "parameters": {"a": 2}}', None, [("add", {"a": 2})]),
        ("llama3_json", '<|python_tag|>{"name": "add", "parameters": {}}; '
         '{"name": "add", "parameters": {"a": 1}}',
         None, [("add", {}), ("add", {"a": 1})]),
        ("llama3_json", "plain {text}", "plain {text}", []),
        ("llama3_json", '{"not": "a call"}', '{"not": "a call"}', []),
    ],
)  # fmt: skip
def test_parsers_whole_and_streamed_agree(fmt, text, content, calls):
    got_content, got_calls = parse_whole(fmt, text)
    assert got_content == content
    assert [(n, json.loads(a)) for n, a in got_calls] == calls
    parser = make_parser(fmt)
    events = [e for ch in text for e in parser.feed(ch)] + parser.finish()
    streamed = [(e[1], json.loads(e[2])) for e in events if e[0] == "call"]
    assert streamed == calls
    streamed_text = "".join(e[1] for e in events if e[0] == "content")
    assert streamed_text.strip() == (content or "").strip()
