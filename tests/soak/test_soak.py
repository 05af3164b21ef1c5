"""CI soak (issue 12): bounded soaks of the deployed two-process stack on a tight KV pool.

What a 64-client soak found and unit tests had missed: n > 1 samples that stop on their first
token leaking blocks (GetStats then INTERNAL KeyError), one huge stop_token_ids list failing
every live request with INTERNAL, a finished request's cleanup killing a new request that
reused its id, and stalls from huge fields. These tests run the same soak small enough for
CI (`make soak` runs the long one).

Only correctness is asserted (status codes, finish reasons, usage, leaks, equal probe
tokens), never speed: a slow machine runs fewer requests per second, and `min_requests`
keeps each soak going until it has done enough to cover the mix. Timeouts are hang guards.
On the 2-core CI VM the module takes ~30 s (stack start ~4 s, mixed soak ~15 s, fan-out
soak ~7 s, stop ~2 s).
"""

from __future__ import annotations

import asyncio

import pytest

from bench.soak import SoakConfig, SoakResult, run_soak, tight_stack

pytestmark = pytest.mark.slow
HANG_GUARD_S = 120.0  # deadline of every soak request: requests here take seconds at most
TEST_TIMEOUT_S = 900  # > hang guard + drain + probes: a hang fails the soak, not pytest-timeout


@pytest.fixture(scope="module")
def stack():
    """One tight stack for both soaks (64 blocks of 4 tokens, 8 running sequences): each soak
    checks that the server ends idle with every block free, so a leak still fails the soak
    that caused it."""
    with tight_stack(num_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=64) as s:
        yield s


def _soak(stack, **overrides) -> SoakResult:
    cfg = SoakConfig(hang_guard_s=HANG_GUARD_S, drain_timeout_s=HANG_GUARD_S, **overrides)
    result = asyncio.run(run_soak(stack.address, cfg))
    print(result.report())
    if not result.ok:
        logs = "\n".join(
            f"--- {n} log (warnings) ---\n{stack.log_tail(n, 3000)}" for n in ("control", "worker")
        )
        pytest.fail(f"soak violations:\n{result.report()}\n{logs}", pytrace=False)
    return result


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_mixed_soak_16_clients(stack):
    """The full mix, one hostile request of each kind (huge id, salt, text, stop-id list)."""
    result = _soak(stack, clients=16, seconds=12, min_requests=80, max_requests=3000, seed=12, max_tokens=32)
    tally = result.tally
    assert tally.requests >= 80
    for kind in ("plain", "cancel", "deadline", "reuse", "hostile-id", "hostile-salt", "hostile-stop"):
        assert tally.kinds[kind] > 0, f"the soak never ran a {kind!r} request: {dict(tally.kinds)}"
    assert tally.codes["OK"] > 0 and tally.finishes["LENGTH"] > 0
    assert tally.beam_searches > 0, "the soak never completed a beam search"


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_fanout_soak_first_token_stops(stack):
    """n > 1 at high temperature with many small stop ids: samples end on their very first
    token at the fan-out, the case that leaked blocks. No hostile requests, no aborts."""
    result = _soak(
        stack,
        clients=16,
        seconds=6,
        min_requests=60,
        max_requests=2000,
        seed=34,
        profile="fanout",
        hostile_fields=(),
        huge_stop_requests=0,
        abort_rate=0.0,
    )
    assert result.tally.first_token_stops >= 20, result.tally.summary(result.wall_s)
