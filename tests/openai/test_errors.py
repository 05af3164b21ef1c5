"""Errors in OpenAI's shape with the status clients branch on: 400 bad input (the front's own
checks and the Engine's INVALID_ARGUMENT), 401, 404, 429 (queue full), 503 (no worker)."""

from __future__ import annotations

import time

import openai
import pytest

from control_plane.scheduler_config import SchedulerConfig
from pagedkv.client import ClientError
from tests.grpc.harness import in_thread
from tests.openai.conftest import serve_sim
from tests.openai.harness import TIMEOUT_S, HttpFront


def assert_error(resp, status: int, param=None, code=None) -> dict:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["type"] == ("invalid_request_error" if status < 429 else error["type"])
    if param is not None:
        assert error["param"] == param
    if code is not None:
        assert error["code"] == code
    return error


def wait_for(predicate, what: str, state=lambda: ""):
    """Poll `predicate` (a hang guard of TIMEOUT_S); `state()` describes what was seen instead."""
    deadline = time.monotonic() + TIMEOUT_S
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}: {state()}"
        time.sleep(0.01)


BAD_COMPLETIONS = [
    ({"temperature": -1}, None, None, "temperature"),  # the Engine's check, its message
    ({"prompt": [99999]}, None, None, "outside the vocabulary"),
    ({"max_tokens": 5000}, None, None, "max length"),
    ({"max_tokens": "many"}, "max_tokens", None, "integer"),
    ({"prompt": None}, "prompt", None, "prompt"),
    ({"prompt": []}, "prompt", None, "empty"),
    ({"prompt": [-1]}, "prompt", None, ">= 0"),
    ({"n": 0}, "n", None, "n must be"),
    ({"top_p": 0}, "top_p", None, "top_p"),
    ({"logprobs": 6}, "logprobs", None, "logprobs must be in [0, 5]"),
    ({"suffix": "x"}, "suffix", "unsupported_parameter", "fill-in-the-middle"),
    ({"best_of": 3}, "best_of", "unsupported_parameter", "use n"),
    ({"presence_penalty": 2.5}, None, None, "presence_penalty must be in [-2, 2]"),
    ({"frequency_penalty": -3}, None, None, "frequency_penalty must be in [-2, 2]"),
    ({"repetition_penalty": 0}, None, None, "repetition_penalty must be > 0"),
    ({"repetition_penalty": -1.5}, None, None, "repetition_penalty must be > 0"),
    ({"logit_bias": {"1": 150}}, None, None, "logit_bias for token 1 must be in [-100, 100]"),
    ({"logit_bias": {"99999": 5}}, None, None, "logit_bias: token id 99999 is outside the vocabulary"),
    ({"logit_bias": {"one": 5}}, "logit_bias", None, "keys must be token ids"),
    ({"allowed_token_ids": [99999]}, None, None, "allowed_token_ids: token id 99999"),
    ({"min_tokens": 10}, None, None, "min_tokens (10) must be <= max_tokens (4)"),
    ({"min_tokens": -1}, "min_tokens", None, "min_tokens must be >= 0"),
    ({"min_p": 1.5}, None, None, "min_p must be in [0, 1]"),
    ({"prompt_logprobs": 21}, "prompt_logprobs", None, "prompt_logprobs must be in [0, 20]"),
    ({"max_tokens": 0, "echo": False}, "max_tokens", None, "0 only with echo"),
    ({"use_beam_search": True, "n": 2, "presence_penalty": 0.5}, None, None, "beam"),
    ({"stream_options": {"include_usage": True}}, "stream_options", None, "stream: true"),
    ({"seed": -1}, "seed", None, "seed"),
]


@pytest.mark.parametrize("fields,param,code,text", BAD_COMPLETIONS, ids=lambda v: str(v)[:40])
def test_bad_completion_requests_are_400(sim, fields, param, code, text):
    before = sim.stack.client.stats().blocks_allocated_total
    with sim.http() as http:
        resp = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 4, **fields})
    error = assert_error(resp, 400, param, code)
    assert text in error["message"]
    assert sim.stack.client.stats().blocks_allocated_total == before  # refused before any block


BAD_CHAT = [
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "top_logprobs must be in [0, 20]"),
    ({"top_logprobs": 2}, "top_logprobs", "needs logprobs: true"),
    ({"echo": True}, "echo", "do not echo"),
    # tools (issue 29): each refused before any block, the param naming the field
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]},
     "tools[0].function.name", "name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
      "properties": {"a": {"type": "nonsense"}}}}}]}, "tools[0].function.parameters", "engine accepts"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]},
     "tools[0].function.parameters", "JSON Schema object"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice", "not among the tools"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required",
      "response_format": {"type": "json_object"}}, "tool_choice", "cannot be combined"),
]  # fmt: skip


@pytest.mark.parametrize("fields,param,text", BAD_CHAT, ids=lambda v: str(v)[:40])
def test_bad_chat_requests_are_400(sim, fields, param, text):
    before = sim.stack.client.stats().blocks_allocated_total
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **fields}
    with sim.http() as http:
        resp = http.post("/v1/chat/completions", json=body)
    error = assert_error(resp, 400, param)
    assert text in error["message"]
    assert sim.stack.client.stats().blocks_allocated_total == before  # refused before any block


def test_a_refused_streaming_request_gets_its_status_not_a_stream(sim):
    with sim.http() as http:
        resp = http.post("/v1/completions", json={"prompt": "x", "temperature": -1, "stream": True})
    assert_error(resp, 400)
    assert not resp.headers["content-type"].startswith("text/event-stream")


def test_off_values_of_refused_fields_are_accepted(sim):
    with sim.http() as http:
        body = {
            "prompt": "x",
            "max_tokens": 2,
            "min_tokens": 0,
            "presence_penalty": 0,
            "best_of": 1,
            "top_k": -1,
        }
        resp = http.post("/v1/completions", json={**body, "echo": False, "user": "u", "logit_bias": {}})
    sim.stack.wait_idle()
    assert resp.status_code == 200, resp.text


def test_malformed_json_unknown_route_and_model(sim):
    with sim.http() as http:
        assert_error(
            http.post("/v1/completions", content=b"{nope", headers={"content-type": "application/json"}), 400
        )
        assert_error(http.get("/v1/nothing"), 404)
        bad_model = http.post(
            "/v1/chat/completions", json={"model": "gpt-4", "messages": [{"role": "user", "content": "x"}]}
        )
    error = assert_error(bad_model, 404, "model", "model_not_found")
    assert "'sim'" in error["message"]
    with pytest.raises(openai.NotFoundError):
        sim.sdk().completions.create(model="nope", prompt="x", max_tokens=2)


def test_a_request_that_can_never_fit_the_pool_is_400_not_429(sim):
    """RESOURCE_EXHAUSTED for "never fits" is not retryable: 400 (prompt + 2000 < max_model_len,
    but the pool holds 63 blocks of 16)."""
    with sim.http() as http:
        resp = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2000})
    error = assert_error(resp, 400, code="request_too_large")
    assert "KV blocks" in error["message"]


def test_api_key(sim):
    keyed = HttpFront(sim.stack.address, sim.stack.loop, api_key="sekret")
    try:
        base = keyed.base_url + "/v1"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=base, api_key="wrong", max_retries=0).models.list()
        assert openai.OpenAI(base_url=base, api_key="sekret", max_retries=0).models.list().data[0].id == "sim"
    finally:
        keyed.close()


def test_queue_full_is_429(hf_model_dir):
    """One sequence runs (its step held by the worker's gate), one waits: the queue (1) is full."""
    served = serve_sim(hf_model_dir, SchedulerConfig(max_num_seqs=1, max_queue=1))
    worker, client = served.stack.worker, served.stack.client
    threads = []
    try:
        worker.gate.clear()
        threads.append(in_thread(lambda: client.complete("running", max_tokens=2))[0])
        wait_for(lambda: client.stats().num_running == 1, "the first request to run")
        threads.append(in_thread(lambda: client.complete("waiting", max_tokens=2))[0])
        wait_for(lambda: client.stats().num_waiting == 1, "the second request to wait")
        with pytest.raises(openai.RateLimitError) as e:
            served.sdk().completions.create(model="sim", prompt="x", max_tokens=2)
        assert e.value.code == "queue_full" and "queue is full" in e.value.message
        with served.http() as http:
            assert_error(http.post("/v1/completions", json={"prompt": "x", "stream": True}), 429)
    finally:
        worker.gate.set()
        for t in threads:
            t.join(TIMEOUT_S)
        served.close()


def test_no_worker_is_503(hf_model_dir):
    served = serve_sim(hf_model_dir)
    try:
        assert served.sdk().completions.create(model="sim", prompt="x", max_tokens=2).choices
        served.stack.kill_worker()
        wait_for(lambda: not served.stack.client.stats().worker_available, "the engine to lose its worker")
        with served.http() as http:
            error = assert_error(http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}), 503)
            assert error["code"] == "unavailable" and error["type"] == "server_error"
            assert http.get("/health").status_code == 503
    finally:
        served.close()


def test_unreachable_engine_is_503():
    front = HttpFront("127.0.0.1:1")  # nothing listens on port 1
    try:
        with pytest.raises(openai.InternalServerError) as e:
            openai.OpenAI(base_url=front.base_url + "/v1", api_key="x", max_retries=0).models.list()
        assert e.value.status_code == 503
    finally:
        front.close()


def test_health_is_200_while_serving(sim):
    with sim.http() as http:
        resp = http.get("/health")
    assert resp.status_code == 200 and resp.json() == {"engine": "SERVING"}


def test_client_error_mapping_covers_every_engine_status():
    """The mapping itself, for codes a live stack cannot easily produce."""
    import grpc

    from pagedkv.openai_api.errors import from_client_error

    cases = {
        grpc.StatusCode.INVALID_ARGUMENT: 400,
        grpc.StatusCode.UNAVAILABLE: 503,
        grpc.StatusCode.DEADLINE_EXCEEDED: 504,
        grpc.StatusCode.UNAUTHENTICATED: 500,
        grpc.StatusCode.INTERNAL: 500,
        grpc.StatusCode.ALREADY_EXISTS: 500,
    }
    for code, status in cases.items():
        assert from_client_error(ClientError(code, "why")).status == status, code
    assert (
        from_client_error(ClientError(grpc.StatusCode.RESOURCE_EXHAUSTED, "the waiting queue is full")).status
        == 429
    )
    too_big = ClientError(grpc.StatusCode.RESOURCE_EXHAUSTED, "Received message larger than max (5 vs. 4)")
    assert from_client_error(too_big).status == 400
