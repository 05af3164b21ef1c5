"""The restart wait: --worker-grace at least, 2x the worker's last start + 2 s, the cap at most."""

from __future__ import annotations

import pytest

from control_plane.restart_wait import restart_wait


@pytest.mark.parametrize(
    ("grace", "start", "cap", "expected", "said"),
    [
        (5.0, 0.0, 300.0, 5.0, "unknown"),  # a worker built in-process reports no start time
        (5.0, 1.0, 300.0, 5.0, "covers"),  # 2x1+2 = 4 <= 5
        (5.0, 5.8, 300.0, 13.6, "5.8s"),  # the embedded model's measured start (issue 40)
        (5.0, 200.0, 300.0, 300.0, "capped"),
        (400.0, 200.0, 300.0, 400.0, "covers"),  # an explicit grace above the cap still wins
    ],
)
def test_restart_wait(grace, start, cap, expected, said):
    wait = restart_wait(grace, start, cap)
    assert wait.seconds == pytest.approx(expected)
    assert said in wait.reason
