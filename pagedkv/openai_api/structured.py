"""The request fields that ask for a structured output, turned into the Engine's
`SamplingParams.structured_output`: OpenAI's `response_format` (`json_object`, `json_schema`)
and vLLM's extras (`guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`, and the
newer `structured_outputs` object). At most one may be set (a 400 naming both otherwise).

The front only checks shapes; whether the engine accepts a schema, regex or grammar is the
Engine's call (INVALID_ARGUMENT naming `sampling.structured_output.*`, before any block is
allocated), which the front returns as a 400.
"""

from __future__ import annotations

import json
from typing import Any

from base.v1 import engine_pb2
from pagedkv.openai_api.errors import bad_request, unsupported

GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs")
# vLLM's structured_outputs keys -> the Engine's StructuredOutput kinds
_STRUCTURED_KEYS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar"}


def _schema_text(value: Any, param: str) -> str:
    """A JSON schema given as an object (or, as vLLM allows, JSON text of one)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise bad_request(f"{param} is not valid JSON: {exc}", param) from None
    if not isinstance(value, dict):
        raise bad_request(f"{param} must be a JSON Schema object", param)
    return json.dumps(value)


def _make(kind: str, value: Any, param: str) -> engine_pb2.StructuredOutput:
    out = engine_pb2.StructuredOutput()
    if kind == "json_schema":
        out.json_schema = _schema_text(value, param)
    elif kind == "json_object":
        out.json_object = True
    elif kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise bad_request(f"{param} must be a non-empty list of non-empty strings", param)
        out.choice.values.extend(value)
    else:
        if not isinstance(value, str) or not value:
            raise bad_request(f"{param} must be a non-empty string", param)
        setattr(out, kind, value)
    return out


def _from_response_format(fmt: Any) -> engine_pb2.StructuredOutput | None:
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return _make("json_object", None, "response_format")
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise bad_request(
                "response_format json_schema needs json_schema: {name, schema, strict}",
                "response_format.json_schema.schema",
            )
        return _make("json_schema", spec["schema"], "response_format.json_schema.schema")
    raise unsupported("response_format", f"type {kind!r}; supported: text, json_object, json_schema")


def _from_structured_outputs(value: Any) -> engine_pb2.StructuredOutput:
    if not isinstance(value, dict):
        raise bad_request("structured_outputs must be an object", "structured_outputs")
    found = [(k, v) for k, v in value.items() if v not in (None, False)]
    if value.get("json_object"):
        found = [(k, v) for k, v in found if k != "json_object"] + [("json_object", True)]
    if len(found) != 1:
        raise bad_request(
            "structured_outputs needs exactly one of json, json_object, regex, choice, grammar",
            "structured_outputs",
        )
    key, spec = found[0]
    if key == "json_object":
        return _make("json_object", None, "structured_outputs.json_object")
    if key not in _STRUCTURED_KEYS:
        raise unsupported(f"structured_outputs.{key}", "supported: json, json_object, regex, choice, grammar")
    return _make(_STRUCTURED_KEYS[key], spec, f"structured_outputs.{key}")


def structured_output(body) -> tuple[str, engine_pb2.StructuredOutput] | None:
    """(the field that set it, the constraint), or None for free text."""
    found: list[tuple[str, engine_pb2.StructuredOutput]] = []
    fmt = _from_response_format(body.response_format)
    if fmt is not None:
        found.append(("response_format", fmt))
    extras = body.model_extra or {}
    for name in GUIDED_FIELDS:
        value = getattr(body, name, None)
        if value is None:
            value = extras.get(name)
        if value is None:
            continue
        if name == "structured_outputs":
            found.append((name, _from_structured_outputs(value)))
        else:
            kind = {"guided_json": "json_schema", "guided_regex": "regex"}.get(
                name, name.removeprefix("guided_")
            )
            found.append((name, _make(kind, value, name)))
    if len(found) > 1:
        names = " and ".join(n for n, _ in found)
        raise bad_request(f"set only one structured output; got {names}", found[1][0])
    return found[0] if found else None
