"""How a response ends: server-sent events, errors mid-stream, and clients that go away.

Whatever ends a response (the last event, a client that hung up, a shutdown
that cancels the handler), the requests it carries are closed, which aborts
in the engine any that have not finished: their KV blocks are free at once.
A stream that cannot go on says so in a last error event, never by hanging.
"""

import asyncio
import json
import logging
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import StreamingResponse

from tinyserve.frontend.request_stream import RequestStream
from tinyserve.errors import InvalidInputError
from tinyserve.frontend.engine_client import EngineDeadError
from tinyserve.outputs import RequestOutput

logger = logging.getLogger("tinyserve.api")


def sse_data(payload: dict | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n"


def sse_event(event: str, payload: dict) -> str:
    return f"event: {event}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"


class EventStreamResponse(StreamingResponse):
    """A text/event-stream response that closes its request streams however it ends.

    The closing cannot live inside the event generator: if the client leaves
    before the first event, Starlette never starts the generator at all.
    """

    def __init__(self, events: AsyncIterator[str], streams: list[RequestStream]) -> None:
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.streams = streams

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await close_all(self.streams)


async def close_all(streams: list[RequestStream]) -> None:
    for stream in streams:
        await stream.close()


async def run_unless_disconnected(coro, request: Request):
    """Run `coro`; if the HTTP client disconnects first, cancel it (which aborts the request).

    Returns the coroutine's result, or None when the client went away.
    """
    task = asyncio.ensure_future(coro)

    async def wait_for_disconnect() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(wait_for_disconnect())
    done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    if task in done:
        watcher.cancel()
        return task.result()
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass
    return None


async def final_output(stream: RequestStream) -> RequestOutput:
    final = None
    async for output in stream:
        final = output
    return final


async def final_outputs_unless_disconnected(streams: list[RequestStream], raw_request: Request) -> list | None:
    """The final output of every stream, or None if the client left first; the streams are closed either way."""
    async def all_of_them():
        tasks = [asyncio.ensure_future(final_output(stream)) for stream in streams]
        try:
            return await asyncio.gather(*tasks)
        finally:
            for task in tasks:  # one failed: the others would wait for ever
                task.cancel()

    try:
        return await run_unless_disconnected(all_of_them(), raw_request)
    finally:
        await close_all(streams)


def engine_dead_message(error: EngineDeadError) -> str:
    """The first line only: the engine's traceback goes to the server log, not to clients."""
    return f"the engine is not available: {str(error).splitlines()[0] if str(error) else 'it stopped'}"


def stream_error_status(error: Exception) -> tuple[int, str]:
    """What a stream says when it cannot go on: the status and message of its error event."""
    if isinstance(error, EngineDeadError):
        return 503, engine_dead_message(error)
    if isinstance(error, InvalidInputError):  # found by the engine (a constraint not compiled in time)
        return 400, str(error)
    logger.error("a stream failed", exc_info=error)
    return 500, "internal error while streaming; see the server log"
