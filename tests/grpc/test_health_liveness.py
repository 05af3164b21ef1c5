"""The control plane's health: "" follows the worker, the "liveness" service does not, so a
Kubernetes liveness probe never restarts a control plane that waits for its worker."""

from __future__ import annotations

import time

import pytest

from control_plane.service import LIVENESS_SERVICE
from pagedkv.client import ClientError


def _wait_for(client, service: str, status: str) -> None:
    deadline = time.monotonic() + 10
    while client.health(service) != status:
        assert time.monotonic() < deadline, f"{service!r} never became {status}"
        time.sleep(0.02)


def test_liveness_stays_serving_while_the_worker_is_gone(stack):
    assert stack.client.health() == "SERVING"
    assert stack.client.health(LIVENESS_SERVICE) == "SERVING"
    stack.kill_worker()
    # An idle engine notices the loss at its next step: give it one (it fails UNAVAILABLE).
    with pytest.raises(ClientError):
        stack.client.complete(token_ids=[1, 2], max_tokens=1)
    _wait_for(stack.client, "", "NOT_SERVING")
    assert stack.client.health(LIVENESS_SERVICE) == "SERVING"
    stack.restart_worker()
    _wait_for(stack.client, "", "SERVING")
    assert stack.client.health(LIVENESS_SERVICE) == "SERVING"
