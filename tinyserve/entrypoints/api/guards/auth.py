"""`--api-key`: every /v1 route wants the key, and every other route that runs the model or the tokenizer
(KEYED_PATHS: /invocations, which answers as chat and completions do, /pooling, /tokenize, /detokenize,
/tokenizer_info); /health, /ping, /load, /version and /metrics stay open, for load balancers and scrapers.

OpenAI clients send `Authorization: Bearer <key>`; Anthropic clients send
`x-api-key: <key>`. Either is accepted on every /v1 route (a client that lists
models before it sends messages sends the same header to both). The comparison
takes the same time whatever the key given, so timing says nothing about the right one.
"""

import hmac

from tinyserve.entrypoints.api.errors import error_response

# The routes outside /v1 that want the key: each runs the model or the tokenizer (/pooling answered without
# the key that /v1/embeddings wants, until hardening-4).
KEYED_PATHS = frozenset({"/invocations", "/pooling", "/tokenize", "/detokenize", "/tokenizer_info"})


def needs_api_key(path: str) -> bool:
    return path.startswith("/v1") or path in KEYED_PATHS


def _given_key(headers: dict[bytes, bytes]) -> bytes:
    authorization = headers.get(b"authorization", b"")
    if authorization[:7].lower() == b"bearer ":
        return authorization[7:]
    return headers.get(b"x-api-key", b"")


class ApiKeyMiddleware:
    """ASGI middleware: 401 in the endpoint's own error format for a missing or wrong key where needs_api_key."""

    def __init__(self, app, *, api_key: str) -> None:
        if not api_key:
            raise ValueError("api_key must not be empty")
        self.app = app
        self.expected = api_key.encode()

    async def __call__(self, scope, receive, send) -> None:
        path = scope.get("path", "")
        if scope["type"] == "http" and needs_api_key(path):
            given = _given_key(dict(scope.get("headers", [])))
            if not hmac.compare_digest(given, self.expected):
                await error_response(path, 401, "invalid or missing API key")(scope, receive, send)
                return
        await self.app(scope, receive, send)
