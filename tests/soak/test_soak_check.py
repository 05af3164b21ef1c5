"""The soak's own checks catch what they claim to (a soak whose checker passes everything
would prove nothing). Pure Python, no server: milliseconds."""

from __future__ import annotations

import random

from base.v1 import engine_pb2
from bench.soak_check import StreamCheck, code_violation, idle_violations
from bench.soak_workload import HUGE_STOP_ID, Geometry, Spec, Workload

EOS = 257
GEO = Geometry(vocab_size=512, block_size=4, pool_tokens=252, max_n=8, eos_token_ids=(EOS,))


def _msg(index, tokens, finish=0, completion=None, prompt=3):
    m = engine_pb2.GenerateResponse(request_id="r", index=index, token_ids=tokens, finish_reason=finish)
    if finish:
        m.usage.prompt_tokens = prompt
        m.usage.completion_tokens = len(tokens) if completion is None else completion
    return m


def _check(spec: Spec, messages, ok=True, aborted_by_peer=False) -> list[str]:
    check = StreamCheck(spec, GEO.vocab_size, GEO.eos_token_ids, "t")
    for m in messages:
        check.feed(m)
    check.finish(ok=ok, aborted_by_peer=aborted_by_peer)
    return check.violations


STOP, LENGTH, ABORT = (
    engine_pb2.FINISH_REASON_STOP,
    engine_pb2.FINISH_REASON_LENGTH,
    engine_pb2.FINISH_REASON_ABORT,
)


def test_a_well_formed_stream_passes():
    spec = Spec("plain", [1, 2, 3], max_tokens=2, n=2, stop_token_ids=[9], request_id="r")
    msgs = [_msg(0, [5]), _msg(1, [9], STOP), _msg(0, [6], LENGTH, completion=2)]
    assert _check(spec, msgs) == []


def test_each_contract_breach_is_reported():
    spec = Spec("plain", [1, 2, 3], max_tokens=4, n=1, stop_token_ids=[9], request_id="r")
    cases = {
        "after its finish": [_msg(0, [9], STOP), _msg(0, [4])],
        "usage says": [_msg(0, [9], STOP, completion=5)],
        "did not end the sample": [_msg(0, [9, 4]), _msg(0, [9], STOP, completion=3)],
        "LENGTH after": [_msg(0, [1, 2], LENGTH)],
        "not a stop id": [_msg(0, [4], STOP)],
        "nobody aborted": [_msg(0, [], ABORT)],
        "without a finish_reason": [_msg(0, [4])],
        "outside [0, 1)": [_msg(3, [4])],
    }
    for what, msgs in cases.items():
        violations = _check(spec, msgs)
        assert any(what in v for v in violations), (what, violations)
    assert _check(spec, [_msg(0, [], ABORT)], aborted_by_peer=True) == []
    assert _check(spec, [_msg(0, [EOS], STOP)]) == []  # EOS stops unless ignore_eos


def test_status_codes_allowed_per_kind():
    plain, hostile = Spec("plain", [1], 1), Spec("hostile-id", [1], 1)
    assert code_violation(plain, "INTERNAL", "t", False)
    assert code_violation(hostile, "INTERNAL", "t", False)
    assert code_violation(hostile, "INVALID_ARGUMENT", "t", False) is None
    assert code_violation(plain, "DEADLINE_EXCEEDED", "t", True) is None
    assert "hang guard" in code_violation(plain, "DEADLINE_EXCEEDED", "t", False)


def test_idle_check_counts_the_null_block_once():
    info = engine_pb2.ModelInfo(facts=engine_pb2.ModelFacts(num_blocks=64))
    idle = engine_pb2.EngineStats(num_blocks_total=63, num_blocks_free=63)
    assert idle_violations(idle, info) == []
    leaked = engine_pb2.EngineStats(num_blocks_total=63, num_blocks_free=60)
    assert any("block leak: 3" in v for v in idle_violations(leaked, info))


def test_huge_stop_list_is_built_on_the_wire():
    spec = Workload(GEO, seed=1).hostile(random.Random(1), "stop")
    spec.huge_stop_ids = 1000  # the real one is 20 Mi ids; the encoding is the same
    req = spec.request_message()
    assert list(req.sampling.stop_token_ids) == [HUGE_STOP_ID] * 1000
    assert req.sampling.n == spec.n == 3 and req.sampling.max_tokens == spec.max_tokens


def test_specs_fit_the_pool_and_the_fanout_profile_fans_out():
    rng = random.Random(5)
    mixed, fanout = Workload(GEO, "mixed", 5), Workload(GEO, "fanout", 5)
    for _ in range(500):
        for spec in (mixed.next_spec(rng), fanout.next_spec(rng)):
            assert 1 <= len(spec.prompt) and len(spec.prompt) + spec.max_tokens <= GEO.pool_tokens
            assert 1 <= spec.n <= 4 and all(0 <= t < GEO.vocab_size for t in spec.stop_token_ids)
    assert all(fanout.next_spec(rng).n >= 2 for _ in range(100))
