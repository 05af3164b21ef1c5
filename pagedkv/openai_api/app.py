"""The ASGI application: state shared by the routes (`Front`), error handlers, API-key check.

The front is a client of the Engine like any other: one `pagedkv.client.AsyncClient` channel,
made in the server's event loop when it starts (lifespan). It holds no engine state; the
ModelInfo it needs (name, limits, tokenizer kind) is re-read at most every
`MODEL_INFO_TTL_S`, so a restarted worker with another model is noticed.
"""

from __future__ import annotations

import hmac
import time
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedkv.client import AsyncClient, ClientError
from pagedkv.logs import get_logger
from pagedkv.openai_api.chat_template import ChatTemplate
from pagedkv.openai_api.errors import ApiError, from_client_error
from pagedkv.security import ClientSecurity
from pagedkv.v1 import engine_pb2

MODEL_INFO_TTL_S = 2.0
log = get_logger("pagedkv.openai")


class Front:
    """Everything a route needs besides its request."""

    def __init__(
        self,
        engine: str,
        *,
        security: ClientSecurity | None = None,
        chat_template: ChatTemplate | None = None,
        model_aliases: tuple[str, ...] = (),
        api_key: str | None = None,
    ) -> None:
        self.engine = engine
        self.security = security or ClientSecurity()
        self.chat_template = chat_template
        self.model_aliases = model_aliases  # names accepted besides ModelInfo.model_name
        self.api_key = api_key
        self.client: AsyncClient | None = None
        self.started = int(time.time())
        self._info: engine_pb2.ModelInfo | None = None
        self._info_at = 0.0

    async def open(self) -> None:
        self.client = AsyncClient(self.engine, security=self.security)

    async def close(self) -> None:
        if self.client is not None:
            await self.client.close()

    async def model_info(self) -> engine_pb2.ModelInfo:
        now = time.monotonic()
        if self._info is None or now - self._info_at > MODEL_INFO_TTL_S:
            try:
                self._info = await self.client.model_info(timeout=10.0)
            except ClientError as e:
                raise from_client_error(e) from None
            self._info_at = now
        return self._info

    async def resolve_model(self, requested: str | None) -> tuple[engine_pb2.ModelInfo, str]:
        """(ModelInfo, the model name to report). A missing or empty `model` means the one
        served model; any other name than its own (or an alias) is a 404."""
        info = await self.model_info()
        if not requested:
            return info, info.model_name
        if requested == info.model_name or requested in self.model_aliases:
            return info, requested
        raise ApiError(
            404,
            f"the model {requested!r} does not exist; this server serves {info.model_name!r}",
            param="model",
            code="model_not_found",
        )


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
    from pagedkv.openai_api.routes import health_router, router

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
