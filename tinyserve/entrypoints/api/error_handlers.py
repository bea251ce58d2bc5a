"""The server's exception handlers: every error answered in the endpoint's own format (errors.py).

    APIError                 its status and message (a handler's own refusal)
    RequestValidationError   400, one message naming the field (of a union, the alternative that got
                             furthest; a check of ours in a validator of the whole body names its own)
    HTTPException            its status (a 405 with Allow); a body nested too deeply: 400
    EngineDeadError          503;  RequestRejectedError: 503 with Retry-After
    InvalidInputError        400 naming the field: a check of the request (renderer, engine)
    any other exception      500, its traceback in the server log, counted in server_errors: only
                             a check of the request may blame the client with a 4xx
"""

import logging
import re
import sys

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from tinyserve.entrypoints.api.errors import APIError, error_response
from tinyserve.entrypoints.api.sse import engine_dead_message
from tinyserve.errors import InvalidInputError
from tinyserve.frontend.async_llm import RequestRejectedError
from tinyserve.frontend.engine_client import EngineDeadError

logger = logging.getLogger("tinyserve.api")

RETRY_AFTER_S = 1  # what a refused client is told to wait: requests finish in seconds
# Where pydantic names the alternative of a union it tried ("str", "list[TextPart]",
# "function-after[...]", a model's class name: no field of these APIs is in CamelCase):
# not a field the client sent, so not part of `param`.
_UNION_MEMBER = re.compile(r"^(str|int|float|bool|none|list|dict)$|\[|^function-|^[A-Z][A-Za-z0-9]*$")


def _location(error: dict) -> list[str]:
    return [str(part) for part in error.get("loc", ())
            if part not in ("body", "path", "query") and not _UNION_MEMBER.search(str(part))]


def _validation_message(error: RequestValidationError) -> tuple[str, str | None]:
    """One message naming the parameter: of a union's failed alternatives, the one that got furthest."""
    errors = error.errors()
    if not errors:
        return "invalid request body", None
    if errors[0].get("type") == "json_invalid":
        reason = (errors[0].get("ctx") or {}).get("error", "malformed")
        return f"the request body is not valid JSON: {reason} (at character {errors[0]['loc'][-1]})", None
    deepest = max(errors, key=lambda e: len(_location(e)))
    # A check of ours that names its field (InvalidInputError) in a validator of the whole body.
    named = getattr((deepest.get("ctx") or {}).get("error"), "param", None)
    location = ".".join(_location(deepest)) or None
    message = deepest.get("msg", "invalid value").removeprefix("Value error, ")  # pydantic's prefix for our checks
    return (f"{location}: {message}" if location else message), location or named


def install_error_handlers(app: FastAPI, metrics) -> None:
    @app.exception_handler(APIError)
    async def on_api_error(request: Request, error: APIError):
        return error_response(request.url.path, error.status, error.message, error.param, error.headers)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, error: RequestValidationError):
        message, param = _validation_message(error)
        return error_response(request.url.path, 400, message, param)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, error: StarletteHTTPException):
        if isinstance(error.__cause__, RecursionError):  # FastAPI's "error parsing the body", said plainly
            return error_response(request.url.path, 400, "the request body nests too deeply: JSON arrays and "
                                  f"objects may nest at most about {sys.getrecursionlimit()} levels")
        # error.headers: Starlette's 405 says which methods the path allows (Allow), as RFC 9110 wants.
        return error_response(request.url.path, error.status_code, str(error.detail), headers=error.headers)

    @app.exception_handler(EngineDeadError)
    async def on_engine_dead(request: Request, error: EngineDeadError):
        return error_response(request.url.path, 503, engine_dead_message(error))

    @app.exception_handler(RequestRejectedError)
    async def on_rejected(request: Request, error: RequestRejectedError):
        if getattr(error, "reason", None) is not None:  # the waiting queue was full (not a drain)
            metrics.record_admission_rejection(error.reason)
        return error_response(request.url.path, 503, str(error), headers={"Retry-After": str(RETRY_AFTER_S)})

    @app.exception_handler(ValueError)
    async def on_value_error(request: Request, error: ValueError):
        if isinstance(error, InvalidInputError):  # a check of the request (renderer, engine); names the field
            return error_response(request.url.path, 400, str(error), error.param)
        # Any other ValueError is the server's own failure (JSON that cannot be written, say), not the client's.
        logger.error("%s %s failed", request.method, request.url.path, exc_info=error)
        return internal_error(request)

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, error: Exception):
        # Starlette logs the traceback after this; the client gets no part of it.
        return internal_error(request)

    def internal_error(request: Request) -> Response:
        route = request.scope.get("route")  # the route's pattern: /v1/responses/{response_id}, not each id
        metrics.server_errors.labels(getattr(route, "path", request.url.path)).inc()
        return error_response(request.url.path, 500, "internal server error; see the server log")
