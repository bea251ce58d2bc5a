"""Server-sent events and cancellation when the client goes away."""

import asyncio
import json

from fastapi import Request


def sse_data(payload: dict | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n"


def sse_event(event: str, payload: dict) -> str:
    return f"event: {event}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"


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
