"""The public gRPC service `pagedkv.v1.Engine` (grpc.aio) over an `AsyncEngine`.

Handlers translate; the engine decides. Every `control_plane.errors.EngineError` becomes the
status its `grpc_code` names, with the exception's message (which says what to change); any
other exception is a server bug: logged with its traceback, INTERNAL to the client, and the
server keeps serving.

A Generate stream ends in one of three ways: every sample finished (OK); the engine failed it
(the failure's status, e.g. UNAVAILABLE when the worker is lost); or the client went away
(cancel, disconnect, deadline) -- grpc cancels the handler and its `finally` aborts the
request, freeing its blocks before the next step is scheduled.
"""

from __future__ import annotations

import asyncio
import functools

import grpc
from grpc_health.v1 import health_pb2

from base.grpc_util import SERVER_OPTIONS, add_health_and_reflection, bind_and_start, set_serving
from base.logs import get_logger
from base.plan_codec import encode_adapter
from base.security import ServerSecurity
from base.service_registry import add_service, checks_malformed, refuse_malformed
from base.v1 import engine_pb2, engine_pb2_grpc
from control_plane import api_codec
from control_plane.engine_loop import AsyncEngine
from control_plane.errors import EngineError, WorkerUnavailableError
from control_plane.limits import MAX_ENGINE_MESSAGE_BYTES, check_request_id, short

SERVICE_NAME = engine_pb2.DESCRIPTOR.services_by_name["Engine"].full_name
# Health service name that is SERVING for as long as the server runs, whatever the worker
# does: a liveness probe (`grpc: {service: liveness}` in Kubernetes) asks "is the process
# answering?", and must not restart a control plane that is waiting for its worker.
LIVENESS_SERVICE = "liveness"
log = get_logger("pagedkv.control")
# The public port takes smaller messages than the worker link (which carries tokenizer.json):
# gRPC refuses a larger request with RESOURCE_EXHAUSTED before parsing it (control_plane.limits).
ENGINE_SERVER_OPTIONS = tuple(
    (k, MAX_ENGINE_MESSAGE_BYTES if k == "grpc.max_receive_message_length" else v) for k, v in SERVER_OPTIONS
)


def _status(e: EngineError) -> grpc.StatusCode:
    return getattr(grpc.StatusCode, e.grpc_code, grpc.StatusCode.INTERNAL)


def _unary(handler):
    """Map EngineError -> its status and unexpected exceptions -> INTERNAL for a unary RPC."""

    @functools.wraps(handler)
    async def wrapped(self, request, context):
        try:
            return await handler(self, request, context)
        except EngineError as e:
            await context.abort(_status(e), str(e))
        except Exception as e:  # noqa: BLE001 -- a bug must not take the server down
            log.exception("rpc.failed", rpc=handler.__name__)
            await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {e!r}")

    return wrapped


class EngineServicer(engine_pb2_grpc.EngineServicer):
    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine

    @checks_malformed  # no wrapper layer on the stream: one hop per token message saved
    async def Generate(self, request, context):
        await refuse_malformed(context, request)
        engine = self.engine
        try:
            token_ids, text, sampling = api_codec.decode_generate(request)
            stream = await engine.submit(
                token_ids,
                text,
                sampling,
                request_id=request.request_id,
                priority=request.priority,
                cache_salt=request.cache_salt,
                images=[image.data for image in request.images],
                adapter=request.adapter,
            )
        except EngineError as e:
            rid = short(request.request_id)
            log.info("request.rejected", request_id=rid, code=e.grpc_code, error=str(e))
            await context.abort(_status(e), str(e))
        rid = stream.request_id
        encode = api_codec.encode_chunk
        try:
            while True:
                try:
                    chunks = await stream.next()
                except EngineError as e:
                    await context.abort(_status(e), str(e))
                for chunk in chunks:
                    yield encode(rid, chunk)
                if stream.drained():
                    return
        finally:
            # Runs on normal completion too (then a no-op) and on cancellation/disconnect.
            # By stream, not by id: the id may already name a newer request (ids can be reused
            # once a request finished, while its slow client is still reading).
            engine.release(stream)

    @_unary
    async def Abort(self, request, context):
        check_request_id(request.request_id)
        n = self.engine.abort(request.request_id)
        log.info("request.aborted", request_id=short(request.request_id), samples=n)
        return engine_pb2.AbortResponse(num_aborted_samples=n)

    @_unary
    async def GetStats(self, request, context):
        e = self.engine
        return api_codec.encode_stats(
            e.stats(), worker_available=e.available, num_live_requests=e.num_live_requests
        )

    @_unary
    async def GetBlockTable(self, request, context):
        check_request_id(request.request_id)
        tables = self.engine.block_tables(request.request_id)
        return api_codec.encode_block_table(request.request_id, self.engine.info.block_size, tables)

    @_unary
    async def GetModelInfo(self, request, context):
        e = self.engine
        if e.info is None or e.scheduler is None:
            raise WorkerUnavailableError("no worker has connected yet; retry shortly")
        s = e.scheduler
        return api_codec.encode_model_info(e.info, e.config, s.max_model_len, s.max_running)

    @_unary
    async def LoadAdapter(self, request, context):
        return encode_adapter(await self.engine.load_adapter(request.name, request.path))

    @_unary
    async def UnloadAdapter(self, request, context):
        await self.engine.unload_adapter(request.name)
        return engine_pb2.UnloadAdapterResponse()

    @_unary
    async def ListAdapters(self, request, context):
        return engine_pb2.ListAdaptersResponse(
            adapters=[encode_adapter(a) for a in self.engine.list_adapters()]
        )

    @_unary
    async def Tokenize(self, request, context):
        ids = await self.engine.tokenize(request.text, request.add_special_tokens)
        return engine_pb2.TokenizeResponse(token_ids=ids, max_model_len=self.engine.scheduler.max_model_len)

    @_unary
    async def Detokenize(self, request, context):
        text, pieces, special = await self.engine.detokenize(request.token_ids, request.skip_special_tokens)
        return engine_pb2.DetokenizeResponse(text=text, token_bytes=pieces, special=special)


async def create_server(
    address: str,
    engine: AsyncEngine,
    *,
    options=ENGINE_SERVER_OPTIONS,
    security: ServerSecurity | None = None,
) -> tuple[grpc.aio.Server, str]:
    """Start `pagedkv.v1.Engine` (+ health, reflection) on `address` and the engine loop.

    Returns (server, the bound address: "host:port" with the real port, or "unix:///path").
    Health ("" and the Engine service) is NOT_SERVING until the engine has connected to its
    worker, and again whenever the worker is lost; LIVENESS_SERVICE is SERVING throughout.
    `security`: TLS and the token check (base.security); None = plaintext, open.
    Shut down with `await shutdown(server, engine, grace)`.
    """
    security = security or ServerSecurity()
    server = grpc.aio.server(options=list(options), interceptors=security.interceptors)
    add_service(server, EngineServicer(engine), engine_pb2.DESCRIPTOR.services_by_name["Engine"])
    health = add_health_and_reflection(server, [SERVICE_NAME])
    await set_serving(health, [SERVICE_NAME], False)
    await health.set(LIVENESS_SERVICE, health_pb2.HealthCheckResponse.SERVING)
    tasks: set[asyncio.Task] = set()

    def on_availability(ok: bool) -> None:
        task = asyncio.get_running_loop().create_task(set_serving(health, [SERVICE_NAME], ok))
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    engine.add_availability_listener(on_availability)
    bound = await bind_and_start(server, address, security.credentials)
    engine.start()
    return server, bound


async def shutdown(server: grpc.aio.Server, engine: AsyncEngine, grace: float = 5.0) -> None:
    """Graceful stop: report NOT_SERVING, refuse new RPCs, let live streams finish for up to
    `grace` seconds, then cancel the rest (their requests are aborted) and stop the engine."""
    engine.drain()
    await asyncio.sleep(0)  # let the health update run before the listener goes away
    await server.stop(grace)
    await engine.stop()
