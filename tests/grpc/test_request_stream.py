"""RequestStream: incremental text, stop strings held back and cut, UTF-8 safety."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from base.tokenizer import ByteTokenizer
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
