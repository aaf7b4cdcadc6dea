"""Server-sent events of a streamed response: the SSE body that cleans up however it ends, one event's
text, and awaiting engine work while watching for the client to disconnect (a 499 then).
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from fastapi import Request
from starlette.responses import StreamingResponse

from atomtool.serve.api.errors import APIError


class EngineStream(StreamingResponse):
    """An SSE response that runs ``on_close`` however it ends (normal end, error, or a client gone before
    the body generator even started, when the generator's own ``finally`` never runs)."""

    def __init__(self, content: Any, on_close: Any) -> None:
        super().__init__(content, media_type="text/event-stream")
        self._on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


def sse_event(obj: Any) -> str:
    """One server-sent event carrying a pydantic model (strict JSON: non-finite floats become null)."""
    return f"data: {obj.model_dump_json()}\n\n"


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(request: Request, coro: Any) -> Any:
    """Await ``coro`` but cancel it if the client disconnects first (its ``finally`` aborts the work).

    Raises:
        APIError: 499 when the client went away (nobody reads the answer; logged as such).
    """
    task = asyncio.ensure_future(coro)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        watcher.cancel()
        raise
    watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    raise APIError(499, "client disconnected")

