"""The ASGI application: the routes, error handlers in OpenAI's shape, the API-key check.
The routes' shared state is a `Front` (pagedkv.openai_api.front) at `app.state.front`."""

from __future__ import annotations

import hmac
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from base.logs import get_logger
from pagedkv.openai_api.errors import ApiError
from pagedkv.openai_api.front import Front
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


def _validation_error(_request: Request, exc: RequestValidationError) -> JSONResponse:
    """pydantic's errors as one 400: `param` is the top-level field (OpenAI's convention)."""
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


def _http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
    kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
    error = ApiError(exc.status_code, str(exc.detail), type=kind)
    return JSONResponse(error.body(), status_code=exc.status_code, headers=getattr(exc, "headers", None))


def _unexpected(_request: Request, exc: Exception) -> JSONResponse:
    log.exception("openai.request_failed", error=repr(exc))
    return JSONResponse(
        ApiError(500, f"internal error: {exc!r}", type="server_error").body(), status_code=500
    )


def create_app(front: Front) -> FastAPI:
    """The FastAPI app serving /v1/models, /v1/completions, /v1/chat/completions, /health."""

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        await front.open()
        try:
            yield
        finally:
            await front.close()

    app = FastAPI(title="pagedkv OpenAI-compatible API", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.front = front
    app.include_router(router, dependencies=[Depends(_check_api_key)])
    app.include_router(health_router)
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected)
    return app
