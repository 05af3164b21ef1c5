"""Errors FastAPI and Starlette raise before a route runs, in OpenAI's shape with a message a
person can act on: a body that is not JSON, not a JSON object, or not sent as JSON (400); an
unknown URL (404); a wrong method (405)."""

from __future__ import annotations

import pytest

from tests.openai.test_errors import assert_error

JSON = {"content-type": "application/json"}
ROUTES = ["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"]


@pytest.mark.parametrize("path", ROUTES)
def test_malformed_json_says_where(sim, path):
    with sim.http() as http:
        resp = http.post(path, content=b'{"prompt": "x",\n  nope}', headers=JSON)
    error = assert_error(resp, 400)
    assert error["param"] is None
    assert error["message"] == (
        "the request body is not valid JSON: Expecting property name enclosed in double quotes "
        "at line 2 column 3"
    )


def test_an_empty_json_document_is_invalid_json(sim):
    with sim.http() as http:
        error = assert_error(http.post("/v1/completions", content=b" ", headers=JSON), 400)
    assert error["message"] == "the request body is not valid JSON: Expecting value at line 1 column 2"


@pytest.mark.parametrize(
    "body,kind",
    [(b"[1, 2]", "an array"), (b'"x"', "a string"), (b"3", "a number"), (b"null", "null")],
)
@pytest.mark.parametrize("path", ROUTES)
def test_a_body_that_is_not_a_json_object(sim, path, body, kind):
    with sim.http() as http:
        error = assert_error(http.post(path, content=body, headers=JSON), 400)
    assert error["message"] == f"the request body must be a JSON object, got {kind}"


@pytest.mark.parametrize("path", ROUTES)
def test_wrong_content_type(sim, path):
    with sim.http() as http:
        plain = http.post(path, content=b'{"prompt": "x"}', headers={"content-type": "text/plain"})
        form = http.post(path, data={"prompt": "x"})  # what curl -d sends without -H
        unlabelled = http.post(path, content=b'{"prompt": "x"}')
    error = assert_error(plain, 400)
    assert error["message"] == "Content-Type must be application/json (got 'text/plain')"
    assert "got 'application/x-www-form-urlencoded'" in assert_error(form, 400)["message"]
    assert assert_error(unlabelled, 400)["message"] == "Content-Type must be application/json (none was sent)"


def test_a_json_suffix_type_is_json(sim):
    """application/*+json is JSON to FastAPI; charset parameters are fine."""
    with sim.http() as http:
        for ct in ("application/json; charset=utf-8", "application/vnd.api+json"):
            resp = http.post("/tokenize", content=b'{"prompt": "ab"}', headers={"content-type": ct})
            assert resp.status_code == 200, resp.text


def test_an_empty_body(sim):
    with sim.http() as http:
        error = assert_error(http.post("/v1/completions", headers=JSON), 400)
    assert (
        error["message"] == "the request body is empty: send a JSON object (Content-Type: application/json)"
    )


def test_field_errors_keep_their_param(sim):
    """A field's error is not mistaken for a whole-body one."""
    with sim.http() as http:
        error = assert_error(http.post("/detokenize", json={"tokens": "abc"}), 400, "tokens")
    assert error["message"].startswith("tokens")


def test_unknown_url_is_404(sim):
    with sim.http() as http:
        resp = http.post("/v1/nothing", json={})
        get = http.get("/v2/models")
    error = assert_error(resp, 404)
    assert error["code"] is None
    assert error["message"].startswith("Invalid URL (POST /v1/nothing); this server serves ")
    for path in ("/v1/chat/completions", "/v1/models/{model_id}", "/tokenize", "/metrics"):
        assert path in error["message"]
    assert assert_error(get, 404)["message"].startswith("Invalid URL (GET /v2/models)")


@pytest.mark.parametrize(
    "method,path,allowed",
    [("GET", "/v1/completions", "POST"), ("POST", "/v1/models", "GET"), ("DELETE", "/tokenize", "POST")],
)
def test_wrong_method_is_405(sim, method, path, allowed):
    with sim.http() as http:
        resp = http.request(method, path)
    error = assert_error(resp, 405)
    assert resp.headers["allow"] == allowed
    assert error["message"] == f"method not allowed ({method} {path}); use {allowed}"
