"""bench.paired_ab's summary: ratios are taken inside each round, so a host whose speed swings
between rounds leaves them intact where best-of picks across rounds would not."""

from bench.common import in_turn
from bench.paired_ab import paired_summary


def test_a_build_twice_as_fast_in_every_round_reads_two_however_the_rounds_swing():
    control = [0.4, 0.1, 0.8, 0.2, 0.1]  # the host 8x faster in some rounds than in others
    build = [c / 2 for c in control]
    s = paired_summary(control, build)
    assert s["ratio_median"] == s["ratio_q1"] == s["ratio_q3"] == 2.0
    assert s["rounds"] == 5 and s["control_median_ms"] == 200.0 and s["build_median_ms"] == 100.0


def test_the_median_ignores_one_disturbed_round():
    s = paired_summary([1.0, 1.0, 1.0, 1.0, 1.0], [0.5, 1.0, 1.0, 1.0, 4.0])
    assert s["ratio_median"] == 1.0 and s["ratio_q1"] < 1.0 < s["ratio_q3"]


def test_the_builds_take_turns_going_first():
    assert in_turn(["a", "b", "c"], 0) == ["a", "b", "c"]
    assert in_turn(["a", "b", "c"], 1) == ["c", "b", "a"]
    assert in_turn(["a", "b", "c"], 1, alternate=False) == ["a", "b", "c"]
