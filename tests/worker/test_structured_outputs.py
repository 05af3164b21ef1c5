"""Structured outputs end to end in one process: the real scheduler driving the real worker on
the embedded default model (random weights: its free output is byte noise, so every output that
parses and validates does so because the grammar constrained it). Covers overlap scheduling
(2 plans in flight), n > 1 forks, and preemption with replay (a pool too small for everyone)."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from base.plan import SamplingParams
from base.sampling import StructuredOutput
from base.tokenizer import ByteTokenizer
from control_plane.engine import EngineCore
from control_plane.request import FinishReason
from control_plane.scheduler_config import SchedulerConfig
from worker import Worker, WorkerConfig

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
    },
    "required": ["name", "age", "color", "tags"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def worker():
    return Worker(WorkerConfig(model=None, num_blocks=48, block_size=4))


def _run(worker, requests, plans_in_flight=2, max_num_seqs=16):
    worker.reset()
    engine = EngineCore(worker, SchedulerConfig(max_num_seqs=max_num_seqs), check_invariants=True,
                        plans_in_flight=plans_in_flight)  # fmt: skip
    for rid, prompt, sampling in requests:
        engine.add_request(rid, prompt, sampling)
    tokens = engine.run_to_completion()
    return tokens, engine.finish_reasons, engine


def _text(ids):
    return ByteTokenizer(512).decode(ids)


def test_json_schema_over_seeds_with_forks_overlap_and_preemption(worker):
    spec = StructuredOutput("json_schema", json.dumps(SCHEMA))
    prompt = list(b"Give me a person as JSON: ")
    requests = [
        (
            f"r{seed}",
            prompt + [seed],
            SamplingParams(max_tokens=120, temperature=1.0, seed=seed, n=2, structured=spec),
        )
        for seed in range(12)
    ]
    tokens, reasons, engine = _run(worker, requests)
    assert len(tokens) == 24
    assert engine.scheduler.stats().num_preemptions > 0, "the pool was meant to force preemption"
    for key, ids in tokens.items():
        assert reasons[key] == FinishReason.STOP, (key, _text(ids))
        jsonschema.validate(json.loads(_text(ids)), SCHEMA)


@pytest.mark.parametrize("plans_in_flight", [1, 2])
def test_regex_choice_grammar_and_json_object(worker, plans_in_flight):
    kinds = {
        "regex": (
            StructuredOutput("regex", r"[a-c]{2,5}-\d{3}"),
            lambda t: re.fullmatch(r"[a-c]{2,5}-\d{3}", t),
        ),
        "choice": (
            StructuredOutput("choice", choices=("yes", "no", "maybe")),
            lambda t: t in ("yes", "no", "maybe"),
        ),
        "gbnf": (
            StructuredOutput("grammar", 'root ::= "(" [0-9]+ ("+" [0-9]+)? ")"'),
            lambda t: re.fullmatch(r"\(\d+(\+\d+)?\)", t),
        ),  # fmt: skip
        "lark": (StructuredOutput("grammar", 'start: "x" ("," "x")*'), lambda t: re.fullmatch(r"x(,x)*", t)),
        "object": (StructuredOutput("json_object"), lambda t: isinstance(json.loads(t), dict)),
    }
    requests = [
        (
            f"{name}-{seed}",
            list(b"go "),
            SamplingParams(max_tokens=60, temperature=1.0, seed=seed, structured=spec),
        )
        for name, (spec, _) in kinds.items()
        for seed in range(4)
    ]
    tokens, reasons, _ = _run(worker, requests, plans_in_flight)
    for (rid, _), ids in tokens.items():
        name = rid.split("-")[0]
        text = _text(ids)
        if name == "object" and reasons[(rid, 0)] == FinishReason.LENGTH:
            continue  # an unbounded object may run to max_tokens: a prefix, documented
        assert reasons[(rid, 0)] == FinishReason.STOP, (rid, text)
        assert kinds[name][1](text), (rid, text)


def test_greedy_constrained_and_free_rows_share_a_batch(worker):
    spec = StructuredOutput("choice", choices=("alpha", "beta"))
    free = SamplingParams(max_tokens=8, ignore_eos=True)
    requests = [
        ("free", list(b"hello"), free),
        ("c", list(b"hello"), SamplingParams(max_tokens=8, structured=spec)),
    ]
    tokens, reasons, _ = _run(worker, requests)
    assert _text(tokens[("c", 0)]) in ("alpha", "beta")
    assert reasons[("c", 0)] == FinishReason.STOP
    alone, _, _ = _run(worker, [("free", list(b"hello"), free)])
    assert alone[("free", 0)] == tokens[("free", 0)], "a constrained neighbour changed a free row"
