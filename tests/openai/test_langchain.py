"""LangChain's ChatOpenAI against the front on the embedded default model (random weights): its
`with_structured_output` in all three methods and `bind_tools` with tool_choice "auto", "any"
and a tool's name. Outputs parse and validate only because decoding was constrained."""

from __future__ import annotations

import json
from typing import Literal

import jsonschema
import pytest
from pydantic import BaseModel, Field

langchain_openai = pytest.importorskip(
    "langchain_openai", reason="langchain-openai is in the test extra: pip install -e '.[test]'"
)

SEEDS = range(3)


class Weather(BaseModel):
    """The weather in a city."""

    city: str = Field(max_length=10)
    degrees: int = Field(ge=-50, le=50)
    sky: Literal["sunny", "cloudy", "rain"]


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def _chat(real, seed: int, **kw):
    return langchain_openai.ChatOpenAI(
        base_url=real.front.base_url + "/v1",
        api_key="unused",
        model=real.model,
        temperature=1.0,
        seed=seed,
        max_retries=0,
        timeout=60,
        **kw,
    )


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_with_structured_output_pydantic(real, method):
    for seed in SEEDS:
        model = _chat(real, seed, max_tokens=300).with_structured_output(Weather, method=method)
        out = model.invoke("What is the weather in Oslo?")
        assert isinstance(out, Weather), out


def test_with_structured_output_json_mode(real):
    """json_mode promises a JSON object, nothing more (LangChain parses it into a dict). An
    object has no size bound, so a random model may run to max_tokens: LangChain then raises
    the SDK's LengthFinishReasonError (the documented cut); most seeds close their object."""
    import openai

    parsed = 0
    for seed in range(6):
        model = _chat(real, seed, max_tokens=600).with_structured_output(method="json_mode")
        try:
            out = model.invoke("Answer in JSON.")
        except openai.LengthFinishReasonError:
            continue
        assert isinstance(out, dict), out
        parsed += 1
    assert parsed >= 3, f"only {parsed} of 6 answers closed their object"


@pytest.mark.parametrize("tool_choice", ["any", "add", "auto"])
def test_bind_tools(real, tool_choice):
    for seed in SEEDS:
        model = _chat(real, seed, max_tokens=600).bind_tools([add, Weather], tool_choice=tool_choice)
        msg = model.invoke("Add 2 and 3.")
        if tool_choice == "auto":  # unconstrained: noise as content, or calls that parsed
            assert isinstance(msg.content, str) and (msg.content or msg.tool_calls)
            continue
        assert msg.tool_calls and not msg.invalid_tool_calls, msg
        if tool_choice == "add":
            assert [c["name"] for c in msg.tool_calls] == ["add"]
        for call in msg.tool_calls:
            if call["name"] == "add":
                jsonschema.validate(call["args"], {"type": "object", "required": ["a", "b"],
                    "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}})  # fmt: skip
            else:
                Weather.model_validate(call["args"])
        assert json.dumps(msg.tool_calls[0]["args"])
