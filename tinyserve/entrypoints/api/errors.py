"""Errors as each API spells them.

OpenAI:    {"error": {"message": ..., "type": ..., "param": ..., "code": ...}}
Anthropic: {"type": "error", "error": {"type": ..., "message": ...}}

Bodies are written as ASCII JSON: a message that quotes what a client sent
(a model name, say) stays encodable whatever that was.
"""

import json

from fastapi.responses import Response

_OPENAI_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
}
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    415: "invalid_request_error",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
}


class APIError(Exception):
    """Raised anywhere in a handler; turned into the endpoint's own error body."""

    def __init__(self, status: int, message: str, param: str | None = None, headers: dict | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.headers = headers


def openai_error_body(status: int, message: str, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": _OPENAI_TYPES.get(status, "invalid_request_error"), "param": param, "code": status}}


def anthropic_error_body(status: int, message: str) -> dict:
    return {"type": "error", "error": {"type": _ANTHROPIC_TYPES.get(status, "invalid_request_error"), "message": message}}


def is_anthropic_path(path: str) -> bool:
    return path.startswith("/v1/messages")


def error_response(path: str, status: int, message: str, param: str | None = None, headers: dict | None = None) -> Response:
    body = anthropic_error_body(status, message) if is_anthropic_path(path) else openai_error_body(status, message, param)
    return Response(json.dumps(body), status_code=status, headers=headers, media_type="application/json")
