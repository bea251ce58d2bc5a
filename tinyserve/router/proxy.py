"""Forwarding one request to a backend and passing its answer back as it arrives.

httpx (the client the project already uses) sends the client's body unchanged with
the router's `traceparent`, and asks for the backend's ORCA load report; the answer's
status, headers and bytes go back as they come: an SSE stream event by event, a JSON
body whole. A backend that refuses the connection is marked down (backends.py) and
the request goes to the next choice; one that fails after it took the request is the
client's 502, since the request may already have run there, and one whose status line
and headers do not come within --backend-header-timeout the client's 504; both are
marked down too.

A backend that goes away mid-answer is marked down, and its answer must not look whole:
an SSE stream ends with an error event naming the backend (the server's own shape for a
stream that cannot go on, entrypoints/api/serving_engine.py's guard_stream), after the last
whole event; any other answer is cut off without its end (the client's HTTP library reports
an incomplete body).
"""

import asyncio
import json
import logging

import httpx
from starlette.background import BackgroundTask
from starlette.responses import StreamingResponse

from tinyserve.entrypoints.api.errors import openai_error_body
from tinyserve.entrypoints.api.load_reports import FORMAT_HEADER, REPORT_HEADER
from tinyserve.router.backends import Backend

logger = logging.getLogger("tinyserve.router")

# Not forwarded either way: they describe one connection, not the request (RFC 9110 §7.6.1).
HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "trailer",
                        "upgrade", "host", "content-length"})
MAX_HELD_BYTES = 1 << 20  # an SSE "event" longer than this without its blank line is passed on as it is


class BackendUnreachable(Exception):
    """The backend could not be connected to: nothing was sent, another may take the request."""


class BackendFailed(Exception):
    """The backend took the request and then failed (502), or sent no answer in time (504)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class AnswerTooLarge(Exception):
    """A backend's answer that the router reads whole is larger than it will hold."""


class BackendDropped(Exception):
    """The backend went away in the middle of an answer that is not an SSE stream: the client's is cut off."""


def forwarded_headers(headers, trace_headers: dict[str, str]) -> dict[str, str]:
    """The client's headers minus hop-by-hop ones and any trace context of its own (the router's span
    is the backend's parent now, inside the client's trace), plus a request for the ORCA report."""
    out = {k: v for k, v in headers.items() if k.lower() not in HOP_BY_HOP | {"traceparent", "tracestate"}}
    out.update(trace_headers)
    out.setdefault(FORMAT_HEADER, "text")
    return out


async def open_response(client: httpx.AsyncClient, backend: Backend, method: str, path: str, body: bytes,
                        headers: dict[str, str], header_timeout_s: float) -> httpx.Response:
    """Send the request; return once the backend's status and headers are in (the body still to come)."""
    request = client.build_request(method, backend.url + path, content=body, headers=headers)
    try:
        return await asyncio.wait_for(client.send(request, stream=True), header_timeout_s)
    except asyncio.TimeoutError:
        message = (f"backend {backend.url} sent no answer within {header_timeout_s:g} s "
                   "(--backend-header-timeout)")
        backend.mark_down(message)
        raise BackendFailed(504, message) from None
    except (httpx.ConnectError, httpx.ConnectTimeout) as error:
        backend.mark_down(f"{type(error).__name__}: {error}")
        raise BackendUnreachable(f"backend {backend.url} is unreachable ({error})") from error
    except httpx.HTTPError as error:
        message = f"backend {backend.url} failed: {type(error).__name__}: {error}"
        backend.mark_down(message)
        raise BackendFailed(502, message) from error


async def read_bounded(response: httpx.Response, limit: int, what: str) -> bytes:
    """A backend's answer, whole, but never more than `limit` bytes of it (AnswerTooLarge past them)."""
    chunks, size = [], 0
    async for chunk in response.aiter_bytes():
        size += len(chunk)
        if size > limit:
            raise AnswerTooLarge(f"{what} is larger than the router reads ({limit} bytes)")
        chunks.append(chunk)
    return b"".join(chunks)


def pass_back(response: httpx.Response, backend: Backend, client_asked_for_report: bool,
              on_close) -> StreamingResponse:
    """The backend's answer as the router's: its bytes as they arrive; on_close(error or None) once the last
    is sent (or the client left)."""
    headers = {k: v for k, v in response.headers.items() if k.lower() not in HOP_BY_HOP}
    if not client_asked_for_report:
        headers.pop(REPORT_HEADER, None)
    is_stream = response.headers.get("content-type", "").startswith("text/event-stream")
    closed = False

    async def close(error: str | None = None):
        nonlocal closed
        if not closed:  # from the body's end, or from the task after it (a client that left skips one)
            closed = True
            await response.aclose()
            on_close(error)

    async def body():
        pending = b""  # an SSE event not yet whole: held back, so that a drop never sends half of one
        try:
            async for chunk in response.aiter_raw():
                if not is_stream:
                    yield chunk
                    continue
                pending += chunk
                whole = _whole_events(pending) if len(pending) <= MAX_HELD_BYTES else len(pending)
                if whole:
                    yield pending[:whole]
                    pending = pending[whole:]
            if pending:
                yield pending
        except httpx.HTTPError as error:
            message = (f"backend {backend.url} stopped in the middle of its answer ({type(error).__name__}: {error}); "
                       "the answer is incomplete")
            backend.mark_down(message)
            await close(message)
            if not is_stream:
                raise BackendDropped(message) from error
            yield f"data: {json.dumps(openai_error_body(502, message))}\n\ndata: [DONE]\n\n".encode()
        finally:
            await close()

    return StreamingResponse(body(), status_code=response.status_code, headers=headers,
                             background=BackgroundTask(close))


def _whole_events(data: bytes) -> int:
    """How many leading bytes of an SSE stream's `data` are whole events (each ends with a blank line)."""
    ends = [at + len(blank) for blank in (b"\n\n", b"\r\n\r\n") if (at := data.rfind(blank)) >= 0]
    return max(ends, default=0)
