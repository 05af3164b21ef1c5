"""RequestStream: incremental text, stop strings held back and cut, UTF-8 safety; a reader
that fell behind gets the queued steps merged, one message per sample."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from base.tokenizer import ByteTokenizer
from control_plane.errors import WorkerUnavailableError
from control_plane.request import FinishReason, RequestOutput, Usage
from control_plane.request_stream import RequestStream


def _feed(stream: RequestStream, text: str, finish_at_end: bool = True):
    """Feed `text` one byte-token at a time; returns (emitted text, matched at token i or None)."""
    data = text.encode()
    emitted = []
    for i, b in enumerate(data):
        last = finish_at_end and i == len(data) - 1
        out = RequestOutput(
            "r", 0, [b], None, FinishReason.LENGTH if last else None, Usage() if last else None
        )
        chunk, dropped = stream.to_chunk(out)
        emitted.append(chunk.text)
        if dropped is not None:
            return "".join(emitted), i
    return "".join(emitted), None


def test_text_without_stops_streams_every_character():
    s = RequestStream("r", 1, ByteTokenizer())
    assert _feed(s, "hello wörld ✓") == ("hello wörld ✓", None)


def test_stop_string_cuts_before_the_match_and_never_leaks_a_prefix():
    s = RequestStream("r", 1, ByteTokenizer(), stops=("STOP",))
    text, at = _feed(s, "abcSTOPdef")
    assert text == "abc"
    assert at == len("abcSTOP") - 1


def test_a_stop_inside_a_multi_token_output_drops_the_tokens_after_it():
    """A speculative verify returns several tokens at once: the chunk keeps those up to the
    one completing the stop string (ids, logprobs, alternatives), and reports how many follow."""
    s = RequestStream("r", 1, ByteTokenizer(), stops=("STOP",))
    first, dropped = s.to_chunk(RequestOutput("r", 0, list(b"abST"), [-1.0] * 4, None, None))
    assert (first.text, first.token_ids, dropped) == ("a", list(b"abST"), None)  # "bST" held back
    tops = [([t], [-0.5]) for t in b"OPxy"]
    chunk, dropped = s.to_chunk(
        RequestOutput("r", 0, list(b"OPxy"), [-2.0] * 4, None, None, top_logprobs=tops)
    )
    assert (chunk.text, chunk.token_ids, chunk.logprobs, dropped) == ("b", list(b"OP"), [-2.0] * 2, 2)
    assert chunk.top_logprobs == tops[:2]


def test_held_back_text_is_flushed_when_the_sample_ends_otherwise():
    s = RequestStream("r", 1, ByteTokenizer(), stops=("xyz!",))
    assert _feed(s, "abc xy") == ("abc xy", None)


def test_earliest_of_several_stops_wins():
    s = RequestStream("r", 1, ByteTokenizer(), stops=("cd", "b"))
    assert _feed(s, "abcd")[0] == "a"


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=30), st.lists(st.text(min_size=1, max_size=4), max_size=3))
def test_emitted_text_is_the_output_cut_at_the_first_stop(text, stops):
    s = RequestStream("r", 1, ByteTokenizer(), stops=tuple(stops))
    emitted, at = _feed(s, text)
    cuts = [text.find(x) for x in stops if x in text]
    if not cuts:
        assert emitted == text and at is None
    else:
        # The match is detected on the token completing the earliest-ending stop occurrence;
        # the text is cut at the earliest *start* among the stops seen by then.
        assert at is not None
        assert text.startswith(emitted)
        assert any(text[len(emitted) :].startswith(x) for x in stops)


def test_done_after_every_sample_finished():
    s = RequestStream("r", 2, None)
    s.push([s.to_chunk(RequestOutput("r", 0, [1], None, FinishReason.STOP, Usage()))[0]])
    assert not s.done
    s.push([s.to_chunk(RequestOutput("r", 1, [2], None, FinishReason.LENGTH, Usage()))[0]])
    assert s.done and not s.drained()


def _step(s: RequestStream, outputs: list[RequestOutput]):
    s.push([s.to_chunk(out)[0] for out in outputs])


def _out(index: int, token: int, finish: bool = False, first: bool = False) -> RequestOutput:
    return RequestOutput(
        "r",
        index,
        [token],
        [-0.5 * token],
        FinishReason.LENGTH if finish else None,
        Usage(prompt_tokens=3, completion_tokens=3) if finish else None,
        top_logprobs=[([token, 0], [-0.5 * token, -9.0])],
        prompt_logprobs=["prompt"] if first else None,
    )


def test_a_reader_that_keeps_up_gets_each_step_as_pushed():
    s = RequestStream("r", 1, ByteTokenizer())
    _step(s, [_out(0, ord("a"), first=True)])
    [chunk] = asyncio.run(s.next())
    assert chunk.token_ids == [ord("a")] and chunk.text == "a" and chunk.prompt_logprobs == ["prompt"]


def test_a_reader_that_fell_behind_gets_one_message_per_sample_with_everything():
    """Three steps of two samples queued: two chunks, each the concatenation of its sample's
    three (tokens, text, logprobs, top logprobs), the finish and usage of its last, the prompt
    logprobs of its first; the stream then drains."""
    s = RequestStream("r", 2, ByteTokenizer())
    _step(s, [_out(0, ord("a"), first=True), _out(1, ord("x"), first=True)])
    _step(s, [_out(0, ord("b")), _out(1, ord("y"))])
    _step(s, [_out(0, ord("c"), finish=True), _out(1, ord("z"), finish=True)])
    first, second = asyncio.run(s.next())
    assert (first.index, second.index) == (0, 1)
    assert first.token_ids == [ord(c) for c in "abc"] and first.text == "abc"
    assert second.token_ids == [ord(c) for c in "xyz"] and second.text == "xyz"
    assert first.logprobs == [-0.5 * ord(c) for c in "abc"]
    assert first.top_logprobs == [([ord(c), 0], [-0.5 * ord(c), -9.0]) for c in "abc"]
    assert first.prompt_logprobs == ["prompt"] and second.prompt_logprobs == ["prompt"]
    assert first.finish_reason == second.finish_reason == FinishReason.LENGTH
    assert first.usage == Usage(prompt_tokens=3, completion_tokens=3)
    assert s.drained()


def test_a_failure_behind_queued_steps_is_raised_after_their_tokens():
    s = RequestStream("r", 1, ByteTokenizer())
    _step(s, [_out(0, ord("a"))])
    _step(s, [_out(0, ord("b"))])
    s.fail(WorkerUnavailableError("worker lost"))

    async def read():
        [chunk] = await s.next()
        assert not s.drained()  # the failure is still to be reported
        with pytest.raises(WorkerUnavailableError, match="worker lost"):
            await s.next()
        return chunk

    assert asyncio.run(read()).token_ids == [ord("a"), ord("b")]
    assert s.drained()
