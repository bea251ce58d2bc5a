"""`x-request-id` on every response: the client's own, echoed, or one made here.

A client (or a proxy in front of the server) that sends `x-request-id` finds the same
value on the response, whatever the status, errors and refusals included, so that its
logs and the server's can be matched; a request without one gets a fresh id. The
middleware is the outermost, so a 401 carries it too.

The same header, or else the body's `request_id`, names a chat or completions answer as
vLLM names it: `chatcmpl-<id>` or `cmpl-<id>` (`client_request_id`).
"""

import uuid

MAX_REQUEST_ID_CHARS = 256  # longer ones are replaced, not echoed: a header is no place for a payload


def _printable(value: bytes) -> bool:
    return 0 < len(value) <= MAX_REQUEST_ID_CHARS and all(0x21 <= byte <= 0x7E for byte in value)


class RequestIdMiddleware:
    """ASGI middleware: add `x-request-id` to the response's headers."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = dict(scope.get("headers", [])).get(b"x-request-id", b"")
        request_id = given if _printable(given) else uuid.uuid4().hex.encode()

        async def send_with_id(message) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"x-request-id"]
                message = {**message, "headers": [*headers, (b"x-request-id", request_id)]}
            await send(message)

        await self.app(scope, receive, send_with_id)


def client_request_id(headers, body_request_id: str | None) -> str | None:
    """The id a client gave a request, read as vLLM's _base_request_id reads it: the x-request-id header (the
    value echoed on the response) wins over the body's request_id; None when it gave neither (or "")."""
    header = headers.get("x-request-id")
    if header is not None and _printable(header.encode("latin-1")):
        return header
    return body_request_id or None


def engine_request_id(response_id: str, chosen_by_client: bool) -> str:
    """The engine's id of a request answered as `response_id`: the same one, unless the client chose it; then
    it ends in 8 random hex digits, as vLLM's engine makes ids unique, so that two requests named alike
    (a retry, say) never clash in the engine, which refuses an id in use."""
    return f"{response_id}-{uuid.uuid4().hex[:8]}" if chosen_by_client else response_id
