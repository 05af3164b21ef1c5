"""Structured outputs through the real openai SDK against the served stack on the embedded
default model: its weights are random, so free output is byte noise and every answer below
parses and validates only because decoding was constrained. Schemas are bounded (maxLength,
enums, integer ranges) so no answer can run to max_tokens inside a string."""

from __future__ import annotations

import json
import re
from typing import Literal

import jsonschema
import pytest
from pydantic import BaseModel, Field

from tests.openai.test_errors import assert_error

SEEDS = range(6)
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "pet": {"enum": ["cat", "dog", "none"]},
    },
    "required": ["name", "age", "pet"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "Describe a person as JSON."}]


class City(BaseModel):
    name: str = Field(max_length=10)
    population: int = Field(ge=0, le=10_000_000)
    capital: bool
    continent: Literal["Europe", "Asia", "Africa", "America", "Oceania"]


def test_parse_with_a_pydantic_model(real):
    client = real.sdk()
    for seed in SEEDS:
        done = client.chat.completions.parse(
            model=real.model, messages=ASK, response_format=City, seed=seed, max_tokens=150
        )
        choice = done.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        assert isinstance(choice.message.parsed, City)
        City.model_validate_json(choice.message.content)


@pytest.mark.parametrize("stream", [False, True])
def test_response_format_json_schema_and_json_object(real, stream):
    client = real.sdk()
    schema_format = {
        "type": "json_schema",
        "json_schema": {"name": "person", "schema": PERSON, "strict": True},
    }
    for seed in SEEDS:
        for fmt in (schema_format, {"type": "json_object"}):
            kw = dict(model=real.model, messages=ASK, response_format=fmt, seed=seed, n=2, max_tokens=150)
            if stream:
                texts = ["", ""]
                for chunk in client.chat.completions.create(stream=True, **kw):
                    for c in chunk.choices:
                        texts[c.index] += c.delta.content or ""
            else:
                texts = [c.message.content for c in client.chat.completions.create(**kw).choices]
            for text in texts:
                if fmt is schema_format:
                    jsonschema.validate(json.loads(text), PERSON)
                else:
                    try:
                        assert isinstance(json.loads(text), dict)
                    except json.JSONDecodeError:  # an unbounded object may be cut by max_tokens
                        assert text.startswith("{") and len(text.encode()) >= 140, text


def test_vllm_guided_extras_on_both_endpoints(real):
    client = real.sdk()
    for seed in SEEDS:
        r = client.completions.create(
            model=real.model,
            prompt="x",
            seed=seed,
            max_tokens=40,
            extra_body={"guided_regex": r"\d{3}-[ab]{2,4}"},
        )
        assert re.fullmatch(r"\d{3}-[ab]{2,4}", r.choices[0].text), r.choices[0].text
        r = client.chat.completions.create(
            model=real.model,
            messages=ASK,
            seed=seed,
            max_tokens=20,
            extra_body={"guided_choice": ["up", "down"]},
        )
        assert r.choices[0].message.content in ("up", "down")
        r = client.chat.completions.create(
            model=real.model, messages=ASK, seed=seed, max_tokens=60, extra_body={"guided_json": PERSON}
        )
        jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)
        r = client.chat.completions.create(
            model=real.model,
            messages=ASK,
            seed=seed,
            max_tokens=30,
            extra_body={"guided_grammar": 'root ::= "go " ("left" | "right") " " [1-9]'},
        )
        assert re.fullmatch(r"go (left|right) [1-9]", r.choices[0].message.content)
        r = client.chat.completions.create(
            model=real.model,
            messages=ASK,
            seed=seed,
            max_tokens=30,
            extra_body={"structured_outputs": {"choice": ["yes", "no"]}},
        )
        assert r.choices[0].message.content in ("yes", "no")


def test_max_tokens_cuts_a_constrained_answer(real):
    """Documented: finish_reason length and a valid prefix, not a valid whole."""
    r = real.sdk().chat.completions.create(
        model=real.model,
        messages=ASK,
        max_tokens=5,
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}},  # fmt: skip
    )
    assert r.choices[0].finish_reason == "length"
    assert r.choices[0].message.content == '{"nam'[: len(r.choices[0].message.content)]


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"response_format": {"type": "json_schema",
                              "json_schema": {"name": "x", "schema": {"type": "wat"}}}},
         "sampling.structured_output.json_schema"),
        ({"guided_regex": "a(b"}, "sampling.structured_output.regex"),
        ({"guided_grammar": 'root ::= "a" missing_rule'}, "sampling.structured_output.grammar"),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
         "response_format.json_schema.schema"),
    ],
)  # fmt: skip
def test_bad_constraints_are_400_naming_the_field_before_any_block(real, extra, param):
    allocated = real.stack.client.stats().blocks_allocated_total
    with real.http() as http:
        r = http.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 4, **extra})
    assert_error(r, 400)
    body = r.json()["error"]
    assert param in body["message"] or body.get("param") == param, body
    assert real.stack.client.stats().blocks_allocated_total == allocated, "a block was allocated"
