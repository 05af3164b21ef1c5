"""Server-sent events and client disconnects.

A client that goes away must stop its generation: the Engine frees a request's KV blocks only
when its gRPC stream is cancelled. Starlette notices a disconnect late or not at all (a
non-streaming handler runs to its end; a streaming body only fails when a write fails, and
nothing is written while a request waits in the queue), so the work runs beside a task that
waits for the ASGI `http.disconnect` message and cancels the work when it comes
(`until_disconnect`). Cancelling reaches `EngineStreams.close`, which cancels the gRPC calls.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable

from starlette.responses import StreamingResponse

DONE_EVENT = b"data: [DONE]\n\n"
SSE_HEADERS = {
    "cache-control": "no-cache",
    "x-accel-buffering": "no",  # proxies (nginx) must not buffer the stream
}


class ClientDisconnected(Exception):
    """The HTTP client closed the connection before the response was complete."""


def sse_event(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


async def _wait_disconnect(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def until_disconnect(receive, work: Awaitable):
    """`await work`, unless the client disconnects first: then the work is cancelled (and
    awaited, so its clean-up has run) and ClientDisconnected is raised."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        raise ClientDisconnected
    finally:
        for t in (task, watcher):
            t.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)


class SSEResponse(StreamingResponse):
    """A response that sends `events` (already-encoded SSE bytes) and stops them when the
    client disconnects. The iterator is always closed (its `finally` blocks run)."""

    def __init__(self, events: AsyncIterator[bytes], headers: dict[str, str] | None = None) -> None:
        super().__init__(events, media_type="text/event-stream", headers={**SSE_HEADERS, **(headers or {})})
        self.events = events

    async def __call__(self, scope, receive, send) -> None:
        async def stream() -> None:
            await send(
                {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
            )
            async for chunk in self.events:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        try:
            await until_disconnect(receive, stream())
        except (ClientDisconnected, OSError):
            pass  # nobody left to tell; the generation was cancelled
        finally:
            await self.events.aclose()
