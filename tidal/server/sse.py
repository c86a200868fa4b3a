"""Server-sent events, keep-alives, and tying a request's life to its client's connection.

Long prefills (a 100k-token agent prompt on a big MoE) can take minutes before the first token;
clients and proxies drop connections that stay silent that long. Streams therefore send a keep-alive
(an SSE comment for OpenAI, a `ping` event for Anthropic) whenever `keepalive_s` passes with nothing
sent. A client that goes away cancels the handler, which closes the engine stream and so aborts the
request; non-streaming handlers poll for the disconnect because nothing else would notice it.
"""
from __future__ import annotations

import asyncio
import json
import time
from contextlib import suppress
from typing import Any, AsyncIterator, Awaitable, Optional, TypeVar

from starlette.requests import Request
from starlette.responses import StreamingResponse

T = TypeVar("T")
KEEPALIVE = ": keep-alive\n\n"   # an SSE comment: clients ignore it, connections stay open
HEARTBEAT = object()   # yielded by `with_heartbeat` when the interval passed without an item
_DISCONNECT_POLL_S = 0.5

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse(data: Any, event: Optional[str] = None) -> str:
    """One SSE message; dicts are sent as compact JSON."""
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return (f"event: {event}\n" if event else "") + f"data: {payload}\n\n"


def sse_response(body: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(body, media_type="text/event-stream", headers=SSE_HEADERS)


async def with_heartbeat(source: AsyncIterator[T], interval: float) -> AsyncIterator[Any]:
    """Yield source's items, and HEARTBEAT each time `interval` seconds pass without one.

    Closing or cancelling this generator cancels the pending read and closes `source`, so an engine
    stream below it aborts its request.
    """
    it = source.__aiter__()
    pending: Optional[asyncio.Future] = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(it.__anext__())
            done, _ = await asyncio.wait({pending}, timeout=interval)
            if not done:
                yield HEARTBEAT
                continue
            finished, pending = pending, None
            try:
                item = finished.result()
            except StopAsyncIteration:
                return
            yield item
    finally:
        if pending is not None:
            pending.cancel()
            with suppress(BaseException):
                await pending
        aclose = getattr(it, "aclose", None)
        if aclose is not None:
            with suppress(BaseException):
                await aclose()


class Pacer:
    """When a stream last sent something: keep-alives go only into silence, including the silence of
    a parser holding text back (a long tool call streams nothing until it closes)."""

    def __init__(self, interval: float):
        self.interval = interval
        self.last = time.monotonic()

    def sent(self) -> None:
        self.last = time.monotonic()

    def due(self) -> bool:
        return time.monotonic() - self.last >= self.interval


class ClientGone(Exception):
    """The client disconnected before a non-streaming response was ready."""


async def unless_disconnected(request: Request, work: Awaitable[T], stream: Any = None) -> T:
    """Await `work`, cancelling it if the client disconnects; then close `stream` (the engine iterator
    `work` reads), which aborts its request if it has not finished."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=_DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise ClientGone()
    finally:
        if not task.done():
            task.cancel()
            with suppress(BaseException):
                await task
        aclose = getattr(stream, "aclose", None)
        if aclose is not None:
            await aclose()
