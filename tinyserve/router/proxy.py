"""Forwarding one request to a backend and passing its answer back as it arrives.

httpx (the client the project already uses) sends the client's body unchanged with
the router's `traceparent`, and asks for the backend's ORCA load report; the answer's
status, headers and bytes go back as they come: an SSE stream chunk by chunk, a JSON
body whole. A backend that refuses the connection is marked down (backends.py) and
the request goes to the next choice; one that fails after it took the request is the
client's 502, since the request may already have run there.
"""

import httpx
from starlette.background import BackgroundTask
from starlette.responses import StreamingResponse

from tinyserve.entrypoints.api.load_reports import FORMAT_HEADER, REPORT_HEADER
from tinyserve.router.backends import Backend

# Not forwarded either way: they describe one connection, not the request (RFC 9110 §7.6.1).
HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "trailer",
                        "upgrade", "host", "content-length"})


class BackendUnreachable(Exception):
    """The backend could not be connected to: nothing was sent, another may take the request."""


class BackendFailed(Exception):
    """The backend took the request and then failed (or timed out): the client gets a 502."""


def forwarded_headers(headers, trace_headers: dict[str, str]) -> dict[str, str]:
    """The client's headers minus hop-by-hop ones and any trace context of its own (the router's span
    is the backend's parent now, inside the client's trace), plus a request for the ORCA report."""
    out = {k: v for k, v in headers.items() if k.lower() not in HOP_BY_HOP | {"traceparent", "tracestate"}}
    out.update(trace_headers)
    out.setdefault(FORMAT_HEADER, "text")
    return out


async def open_response(client: httpx.AsyncClient, backend: Backend, method: str, path: str, body: bytes,
                        headers: dict[str, str]) -> httpx.Response:
    """Send the request; return once the backend's status and headers are in (the body still to come)."""
    request = client.build_request(method, backend.url + path, content=body, headers=headers)
    try:
        return await client.send(request, stream=True)
    except (httpx.ConnectError, httpx.ConnectTimeout) as error:
        backend.mark_down(f"{type(error).__name__}: {error}")
        raise BackendUnreachable(f"backend {backend.url} is unreachable ({error})") from error
    except httpx.HTTPError as error:
        raise BackendFailed(f"backend {backend.url} failed: {type(error).__name__}: {error}") from error


def pass_back(response: httpx.Response, client_asked_for_report: bool, on_close) -> StreamingResponse:
    """The backend's answer as the router's: its bytes as they arrive; on_close() once the last is sent
    (or the client left)."""
    headers = {k: v for k, v in response.headers.items() if k.lower() not in HOP_BY_HOP}
    if not client_asked_for_report:
        headers.pop(REPORT_HEADER, None)

    closed = False

    async def close():
        nonlocal closed
        if not closed:  # from the body's end, or from the task after it (a client that left skips one)
            closed = True
            await response.aclose()
            on_close()

    async def body():
        try:
            async for chunk in response.aiter_raw():
                yield chunk
        except httpx.HTTPError:
            return  # the backend went away mid-answer: the client sees the stream end where it stopped
        finally:
            await close()

    return StreamingResponse(body(), status_code=response.status_code, headers=headers,
                             background=BackgroundTask(close))
