"""Registering a pagedkv gRPC service so that a malformed request is the caller's error.

The generated `add_*Servicer_to_server` functions deserialize with `Message.FromString`; when
that raises (truncated bytes, a wrong message type, invalid UTF-8 in a `string` field) gRPC
answers UNKNOWN and logs a traceback, as if the server had failed. Here the same handlers
are built from the service descriptor with a lenient deserializer: a request that does not
parse becomes a `MalformedRequest`, and the method answers INVALID_ARGUMENT with what was
wrong, without ever calling the servicer.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc
from google.protobuf import message_factory
from google.protobuf.descriptor import ServiceDescriptor
from google.protobuf.message import DecodeError

_MAKERS = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


@dataclass(slots=True, frozen=True)
class MalformedRequest:
    message_type: str
    error: str

    def describe(self) -> str:
        return (
            f"the request is not a valid {self.message_type} ({self.error}); check that the client "
            "uses this server's .proto (reflection serves it) and that every string field is UTF-8"
        )


def _lenient(message_class):
    full_name = message_class.DESCRIPTOR.full_name

    def deserialize(data: bytes):
        try:
            return message_class.FromString(data)
        except (DecodeError, ValueError) as e:  # noqa: BLE001 -- upb raises DecodeError
            return MalformedRequest(full_name, str(e) or type(e).__name__)

    return deserialize


async def _refuse(context, request: MalformedRequest) -> None:
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.describe())


def checks_malformed(method):
    """Mark a servicer method that handles `MalformedRequest` itself (see `refuse_malformed`):
    it is registered as is, with no wrapper. For hot streams: each wrapper layer costs an
    async-generator hop per message (ExecuteStream carries every step's plan)."""
    method.checks_malformed = True
    return method


async def refuse_malformed(context, request) -> None:
    """For `checks_malformed` methods: answer INVALID_ARGUMENT if `request` did not parse."""
    if type(request) is MalformedRequest:
        await _refuse(context, request)


def _guard(behavior, name: str, streaming: bool):
    """`behavior` with malformed requests answered INVALID_ARGUMENT before it runs. Streaming
    methods check for themselves (`checks_malformed`): a wrapper there would cost a hop per
    message, and every pagedkv stream is on a hot path."""
    if getattr(behavior, "checks_malformed", False):
        return behavior
    if streaming:
        raise TypeError(f"streaming method {name} must handle malformed requests (@checks_malformed)")

    async def unary_unary(request, context):
        if type(request) is MalformedRequest:
            await _refuse(context, request)
        return await behavior(request, context)

    return unary_unary


def add_service(server: grpc.aio.Server, servicer, service: ServiceDescriptor) -> None:
    """Register every method of `service` on `server`, served by `servicer`'s same-named methods."""
    handlers = {}
    for method in service.methods:
        request_class = message_factory.GetMessageClass(method.input_type)
        response_class = message_factory.GetMessageClass(method.output_type)
        streams = (method.client_streaming, method.server_streaming)
        handlers[method.name] = _MAKERS[streams](
            _guard(getattr(servicer, method.name), method.full_name, any(streams)),
            request_deserializer=_lenient(request_class),
            response_serializer=response_class.SerializeToString,
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))
    server.add_registered_method_handlers(service.full_name, handlers)
