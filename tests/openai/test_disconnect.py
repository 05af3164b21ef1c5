"""A client that disconnects aborts its engine requests: every KV block is free again.

Each request asks for far more tokens than it will get (MAX_TOKENS steps of >= DELAY_S each):
the proof is that the engine went idle after only a few steps, which only an abort explains
(a request left running would take MAX_TOKENS steps before its blocks were freed). The waits
are bounded hang guards, not timing assertions.
"""

from __future__ import annotations

import json
import socket

import httpx
import pytest

from tests.openai.conftest import serve_sim
from tests.openai.harness import TIMEOUT_S
from tests.openai.test_errors import wait_for

MAX_TOKENS = 900  # the pool holds 63 x 16 = 1008 tokens
DELAY_S = 0.01  # per worker step: a request running to the end would take >= 9 s


@pytest.fixture(scope="module")
def slow(hf_model_dir):
    served = serve_sim(hf_model_dir, worker={"delay_s": DELAY_S})
    yield served
    served.close()


def _assert_aborted(served, steps_before: int, num_sequences: int) -> None:
    stats = served.stack.wait_idle(TIMEOUT_S)
    assert stats.num_blocks_free == stats.num_blocks_total
    steps = served.stack.worker.num_executes - steps_before
    assert steps < MAX_TOKENS // 2, f"{steps} steps: the request ran on after the client left"
    assert stats.num_finished_requests >= num_sequences


def test_streaming_disconnect_frees_every_block(slow):
    """A batch of 2 prompts x n=2: all four sequences are aborted."""
    before = slow.stack.worker.num_executes
    body = {"prompt": ["one", "two"], "n": 2, "max_tokens": MAX_TOKENS, "stream": True}
    with httpx.Client(base_url=slow.front.base_url, timeout=TIMEOUT_S) as http:
        with http.stream("POST", "/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            lines = resp.iter_lines()
            first = next(line for line in lines if line.startswith("data: {"))
            assert json.loads(first[6:])["choices"]
            assert slow.stack.client.stats().num_blocks_free < slow.stack.client.stats().num_blocks_total
    _assert_aborted(slow, before, 2)


def _post_raw(port: int, path: str, body: dict) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT_S)
    data = json.dumps(body).encode()
    head = f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    sock.sendall(head.encode() + f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_non_streaming_disconnect_frees_every_block(slow, path):
    before = slow.stack.worker.num_executes
    body = {"max_tokens": MAX_TOKENS}
    body.update({"prompt": "x"} if "chat" not in path else {"messages": [{"role": "user", "content": "x"}]})
    sock = _post_raw(slow.front.port, path, body)
    try:
        wait_for(lambda: slow.stack.client.stats().num_running == 1, "the request to run")
    finally:
        sock.close()
    _assert_aborted(slow, before, 1)


def test_disconnect_before_the_first_token_frees_every_block(slow):
    """The stream's 200 waits for the first token; leaving during that wait aborts too."""
    before = slow.stack.worker.num_executes
    slow.stack.worker.gate.clear()  # the first step is held: no token yet
    try:
        sock = _post_raw(
            slow.front.port, "/v1/completions", {"prompt": "x", "max_tokens": MAX_TOKENS, "stream": True}
        )
        # Live in the engine; whichever step is in flight (maybe one that only retires the previous
        # test's sequences) is held, so no token can come.
        stats = slow.stack.client.stats
        wait_for(
            lambda: stats().num_live_requests == 1, "the request to reach the engine", lambda: str(stats())
        )
        sock.close()
    finally:
        slow.stack.worker.gate.set()
    _assert_aborted(slow, before, 1)
