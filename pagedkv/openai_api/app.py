"""The ASGI application: the routes, error handlers in OpenAI's shape, the API-key check,
the request metrics middleware.

Every error is `{"error": {"message", "type", "param", "code"}}` with its status, also those
FastAPI and Starlette produce themselves: a body that is not JSON, not a JSON object or not
sent as application/json (400, with a message that says which), an unknown URL (404) and a
wrong method (405, with its Allow header). The routes' shared state is a `Front`
(pagedkv.openai_api.front) at `app.state.front`; the request metrics (front_metrics.py) are at
`app.state.request_metrics`.
"""

from __future__ import annotations

import email.message
import hmac
import json
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from base.logs import get_logger
from pagedkv.openai_api import extras, lora_routes
from pagedkv.openai_api.errors import ApiError, bad_request
from pagedkv.openai_api.front import Front
from pagedkv.openai_api.front_metrics import RequestMetrics, RequestMetricsMiddleware
from pagedkv.openai_api.routes import health_router, router

log = get_logger("pagedkv.openai")


def _check_api_key(request: Request) -> None:
    key = request.app.state.front.api_key
    if key is None:
        return
    sent = request.headers.get("authorization", "")
    scheme, _, token = sent.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
        raise ApiError(
            401, "missing or wrong API key (send 'Authorization: Bearer <key>')", code="invalid_api_key"
        )


def _is_json(content_type: str | None) -> bool:
    """FastAPI's own test: only application/json or application/*+json bodies are parsed."""
    if not content_type:
        return False
    message = email.message.Message()
    message["content-type"] = content_type
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (
        subtype == "json" or subtype.endswith("+json")
    )


_JSON_KINDS = {
    list: "an array",
    str: "a string",
    bool: "a boolean",
    int: "a number",
    float: "a number",
    type(None): "null",
}


def _body_error(request: Request, exc: RequestValidationError) -> ApiError | None:
    """The 400 for a body that is wrong as a whole (None if it is a field's error). FastAPI
    reports these as field errors with no field: "JSON decode error" at a character offset, or
    "Input should be a valid dictionary" for an array, a text/plain body, a missing body."""
    first = exc.errors()[0] if exc.errors() else {}
    loc = tuple(first.get("loc", ()))
    if first.get("type") == "json_invalid" and isinstance(exc.body, str):
        e = json.JSONDecodeError(first.get("ctx", {}).get("error", "invalid JSON"), exc.body, loc[-1])
        return bad_request(f"the request body is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}")
    if loc != ("body",):
        return None
    if first.get("type") == "missing":
        return bad_request("the request body is empty: send a JSON object (Content-Type: application/json)")
    content_type = request.headers.get("content-type")
    if not _is_json(content_type):
        got = f"got {content_type!r}" if content_type else "none was sent"
        return bad_request(f"Content-Type must be application/json ({got})")
    kind = _JSON_KINDS.get(type(first.get("input")), "not an object")
    return bad_request(f"the request body must be a JSON object, got {kind}")


def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    """pydantic's errors as one 400: `param` is the top-level field (OpenAI's convention)."""
    whole = _body_error(request, exc)
    if whole is not None:
        return JSONResponse(whole.body(), status_code=400)
    errors = exc.errors()
    locs = [[str(p) for p in e.get("loc", ()) if p != "body"] for e in errors] or [[]]
    param = locs[0][0] if locs[0] else None
    message = errors[0].get("msg", "invalid request body") if errors else "invalid request body"
    if len(errors) > 1 and len({tuple(loc[:1]) for loc in locs}) == 1:  # one field, a union's forms
        text = f"{param}: matches none of its accepted forms (e.g. {message})"
    else:
        text = f"{'.'.join(locs[0])}: {message}" if param else message
        if len(errors) > 1:
            text += f" (and {len(errors) - 1} more problem(s))"
    return JSONResponse(ApiError(400, text, param=param).body(), status_code=400)


def _api_error(_request: Request, exc: ApiError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status)


def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
    message = str(exc.detail)
    where = f"{request.method} {request.url.path}"
    if exc.status_code == 404 and exc.detail == "Not Found":  # the router's: no route matched
        message = f"Invalid URL ({where}); this server serves {', '.join(request.app.state.paths)}"
    elif exc.status_code == 405:
        allowed = (exc.headers or {}).get("Allow", "")
        message = f"method not allowed ({where}); use {allowed or 'another method'}"
    error = ApiError(exc.status_code, message, type=kind)
    return JSONResponse(error.body(), status_code=exc.status_code, headers=getattr(exc, "headers", None))


def _unexpected(_request: Request, exc: Exception) -> JSONResponse:
    log.exception("openai.request_failed", error=repr(exc))
    return JSONResponse(
        ApiError(500, f"internal error: {exc!r}", type="server_error").body(), status_code=500
    )


def create_app(front: Front) -> FastAPI:
    """The FastAPI app serving /v1/models, /v1/models/{model}, /v1/completions,
    /v1/chat/completions, /tokenize, /detokenize, /tokenizer_info (behind the API key, if
    any) and /health, /version, /metrics (open)."""

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        await front.open()
        try:
            yield
        finally:
            await front.close()

    app = FastAPI(title="pagedkv OpenAI-compatible API", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.front = front
    app.state.request_metrics = RequestMetrics()
    app.include_router(router, dependencies=[Depends(_check_api_key)])
    app.include_router(extras.router, dependencies=[Depends(_check_api_key)])
    app.include_router(lora_routes.router, dependencies=[Depends(_check_api_key)])
    app.include_router(health_router)
    app.include_router(extras.open_router)
    served = (router, extras.router, health_router, extras.open_router)
    app.state.paths = sorted({r.path.replace(":path}", "}") for rt in served for r in rt.routes})  # for 404s
    app.add_middleware(RequestMetricsMiddleware, metrics=app.state.request_metrics)
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected)
    return app
