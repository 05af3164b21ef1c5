"""Speculative decoding through the served stack (Engine gRPC -> engine loop with 2 plans in
flight -> Worker gRPC -> SimWorker, which verifies by reading K/V back through the tables):
reference tokens, exact usage, the per-request opt-out, and the counters in GetStats."""

from __future__ import annotations

import threading

from control_plane.sim_worker import reference_tokens
from control_plane.speculation import SpeculativeConfig

VOCAB = 4  # no tokenizer: token ids only, a tiny vocabulary so proposals are often accepted


def test_served_speculation_gives_reference_tokens_and_reports_its_counters(make_stack):
    stack = make_stack(
        {"vocab_size": VOCAB, "tokenizer": "none", "block_size": 2},
        speculative=SpeculativeConfig("ngram", 3, 1, 3),
    )
    prompts = [[0, 1, 2, 3] * 4, [1, 1, 2, 2] * 3, [3, 2, 1] * 5]
    got: dict[int, list] = {}

    def run(i: int) -> None:
        got[i] = stack.client.complete(token_ids=prompts[i], max_tokens=30, n=2, ignore_eos=True)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for i, prompt in enumerate(prompts):
        for c in got[i]:
            assert c.token_ids == reference_tokens(prompt, c.index, 30, VOCAB), (i, c.index)
            assert c.usage.completion_tokens == 30 and c.finish_reason == "LENGTH"
    s = stack.wait_idle()
    assert s.spec_num_verifies > 0 and 0 < s.spec_num_accepted < s.spec_num_proposed, s
    assert len(s.spec_acceptance_per_position) == 3
    before = s.spec_num_verifies
    (c,) = stack.client.complete(
        token_ids=prompts[0], max_tokens=30, ignore_eos=True, disable_speculation=True
    )
    assert c.token_ids == reference_tokens(prompts[0], 0, 30, VOCAB)
    assert stack.wait_idle().spec_num_verifies == before  # opted out: no verify step


def test_served_stop_strings_inside_accepted_runs_cut_tokens_and_usage_exactly(make_stack):
    """Stop strings end a sample inside a draft verify's accepted run (the SimWorker's draft
    stand-in is right two proposals in three, k = 4): the tokens after the one completing the
    stop are neither streamed nor counted. Byte tokenizer; each stop is one printable
    character of the reference output, so the cut is the first token decoding to it."""
    from base.tokenizer import make_tokenizer

    stack = make_stack({"tokenizer": "byte", "block_size": 2}, speculative=SpeculativeConfig("draft", 4))
    vocab = 512  # tests/grpc/conftest.py ScriptedWorker
    tok = make_tokenizer("byte", "", vocab)
    checked = 0
    for prompt in ([0, 1, 2, 3] * 4, [70, 71] * 5, [300, 5, 99] * 3, [9] * 7):
        ref = reference_tokens(prompt, 0, 40, vocab)
        stops = sorted({chr(t) for t in ref[3:] if 33 <= t < 127}, key=lambda ch: ref.index(ord(ch)))[:3]
        for stop in stops:
            n = next(n for n in range(1, len(ref) + 1) if stop in tok.decode(ref[:n]))
            (c,) = stack.client.complete(token_ids=prompt, max_tokens=40, ignore_eos=True, stop=[stop])
            assert c.token_ids == ref[:n], (prompt, stop)
            assert c.usage.completion_tokens == n and c.finish_reason == "STOP"
            checked += 1
    assert checked >= 4
    s = stack.wait_idle()
    assert s.spec_num_verifies > 0 and 0 < s.spec_num_accepted < s.spec_num_proposed, s
