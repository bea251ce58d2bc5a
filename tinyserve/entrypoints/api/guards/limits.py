"""What a request body may be, checked before anything parses it (stage ①, first thing).

    POST /v1/chat/completions
      │ Content-Type not JSON?                        → 415
      │ Content-Length over max_request_body_bytes?   → 413 at once, nothing read
      │ read the body, counting bytes as they arrive  → 413 as soon as the count passes the limit
      ▼                                                  (chunked bodies have no Content-Length)
    the app, which receives the body already read

The body is read here, whole, so that the limit holds however it is sent; the
app is then handed the same bytes as if it read them from the socket, and
every later `receive()` (a disconnect, say) comes from the client as usual.
"""

from tinyserve.entrypoints.api.defaults import DEFAULT_MAX_REQUEST_BODY_BYTES  # the CLI's too
from tinyserve.entrypoints.api.errors import error_response


def _is_json(content_type: str) -> bool:
    media_type = content_type.split(";", 1)[0].strip().lower()
    return media_type == "application/json" or (media_type.startswith("application/") and media_type.endswith("+json"))


class RequestLimitsMiddleware:
    """ASGI middleware: 415 for non-JSON bodies on `json_paths`, 413 for bodies over `max_body_bytes`."""

    def __init__(self, app, *, max_body_bytes: int, json_paths: frozenset[str]) -> None:
        if max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be at least 1, got {max_body_bytes}")
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.json_paths = json_paths

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        headers = dict(scope.get("headers", []))
        content_type = headers.get(b"content-type")
        # No Content-Type at all is taken as JSON, as FastAPI does; a declared other type is refused.
        if path in self.json_paths and content_type is not None and not _is_json(content_type.decode("latin-1")):
            await error_response(path, 415, f"Content-Type must be application/json, got {content_type.decode('latin-1')!r}")(
                scope, receive, send)
            return
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            await self._too_large(scope, receive, send)
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left before sending its body: nobody to answer
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                await self._too_large(scope, receive, send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _too_large(self, scope, receive, send) -> None:
        message = f"request body is larger than the limit of {self.max_body_bytes} bytes (--max-request-body-bytes)"
        await error_response(scope["path"], 413, message)(scope, receive, send)
