"""The control plane's admission check of structured outputs (torch-free): rejected specs are
InvalidRequestError naming the field, a compile past the time limit is refused without
blocking the loop, and specs that compiled are cached."""

from __future__ import annotations

import asyncio
import json

import pytest

from base.sampling import StructuredOutput
from base.tokenizer import ByteTokenizer
from control_plane.errors import InvalidRequestError
from control_plane.grammar_check import GrammarCheck

SCHEMA = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(20)}}


def _check(timeout_s=10.0) -> GrammarCheck:
    return GrammarCheck(ByteTokenizer(512), 512, (257,), timeout_s)


@pytest.mark.parametrize(
    "spec, field",
    [
        (StructuredOutput("json_schema", '{"type": "nonsense"}'), "sampling.structured_output.json_schema"),
        (StructuredOutput("json_schema", "{oops"), "sampling.structured_output.json_schema"),
        (StructuredOutput("regex", "a(b"), "sampling.structured_output.regex"),
        (StructuredOutput("grammar", "start: missing"), "sampling.structured_output.grammar"),
        (StructuredOutput("choice", choices=()), "sampling.structured_output.choice"),
        (StructuredOutput("wat", "x"), "sampling.structured_output"),
    ],
)
def test_rejected_specs_name_the_field(spec, field):
    with pytest.raises(InvalidRequestError, match=field.replace(".", r"\.")):
        asyncio.run(_check().check(spec))


def test_compile_past_the_limit_is_refused_then_cached():
    async def run():
        check = _check(timeout_s=1e-6)
        spec = StructuredOutput("json_schema", json.dumps(SCHEMA))
        ticks = 0

        async def ticker():  # the loop keeps running while the grammar compiles on a thread
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0)

        task = asyncio.create_task(ticker())
        with pytest.raises(InvalidRequestError, match="did not compile within"):
            await check.check(spec)
        for _ in range(200):  # the abandoned compile finishes in the background ...
            if check._compiler is not None and check._compiler.cached(spec) is not None:
                break
            await asyncio.sleep(0.01)
        await check.check(spec)  # ... and its result is the cache: accepted at once
        task.cancel()
        assert ticks > 0

    asyncio.run(run())
