"""The FastAPI app: routes, authentication, error bodies, health and metrics.

Handlers live in serving_chat.py (chat), serving_completion.py,
responses_serving.py, anthropic_serving.py and serving_tokenization.py; this file wires
them to URLs and makes sure that every failure, including a malformed body,
answers in the endpoint's own error format with a 4xx/5xx status, and never
with a traceback. A request passes, outermost first:

    RequestIdMiddleware      x-request-id on the response: the client's, or a new one
    ApiKeyMiddleware         401 on /v1 without the key (with --api-key)
    TracingMiddleware        the HTTP span, the root of the request's trace
    RequestLimitsMiddleware  415 for non-JSON, 413 for bodies over the limit
    LoadReportsMiddleware    ORCA load reports, the in-flight count of /load (load_reports.py)
    the route                pydantic validates the body (400), the handler runs
"""

import gc
import logging
import re
import sys
from contextlib import asynccontextmanager
from typing import Annotated

from fastapi import FastAPI, Path, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

import tinyserve
from tinyserve.frontend.async_llm import RequestRejectedError
from tinyserve.errors import InvalidInputError
from tinyserve.frontend.engine_client import EngineDeadError
from tinyserve.entrypoints.api import serving_tokenization
from tinyserve.entrypoints.api.other_apis.anthropic_serving import (
    MessagesCountTokensRequest,
    MessagesRequest,
    count_tokens,
    create_message,
)
from tinyserve.entrypoints.api.guards.auth import ApiKeyMiddleware
from tinyserve.entrypoints.api.serving_completion import create_completion
from tinyserve.entrypoints.api.errors import APIError, error_response
from tinyserve.entrypoints.api.guards.field_limits import FieldLimits
from tinyserve.entrypoints.api.guards.limits import DEFAULT_MAX_REQUEST_BODY_BYTES, RequestLimitsMiddleware
from tinyserve.entrypoints.api.load_reports import LoadReportsMiddleware, ServerLoad
from tinyserve.entrypoints.api.metrics import ServerMetrics
from tinyserve.entrypoints.api.openapi import make_truthful
from tinyserve.entrypoints.api.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from tinyserve.entrypoints.api.serving_chat import create_chat_completion
from tinyserve.entrypoints.api.serving_engine import ServingContext
from tinyserve.entrypoints.api.request_ids import RequestIdMiddleware
from tinyserve.entrypoints.api.other_apis.responses_protocol import RESPONSE_ID_PATTERN, ResponsesRequest, ResponseStore
from tinyserve.entrypoints.api.other_apis.responses_serving import create_response
from tinyserve.entrypoints.api.sse import engine_dead_message
from tinyserve.lifecycle.http_spans import TracingMiddleware
from tinyserve.lifecycle.tracing import shutdown_tracing

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


def build_app(
    ctx: ServingContext,
    metrics: ServerMetrics,
    *,
    api_key: str | None = None,
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES,
    field_limits: FieldLimits = FieldLimits(),
    track_server_load: bool = False,
) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await ctx.engine.start()
        ctx.engine.stat_loggers.append(metrics)
        metrics.record_cache_config(ctx.engine.engine_args, ctx.engine.client.num_kv_blocks)
        # What is loaded by now (torch, transformers, the app) lives as long as the server. Frozen,
        # it is no longer walked by every full garbage collection, each of which would stop the
        # event loop for a few hundred milliseconds (vLLM freezes its start-up heap too).
        gc.collect()
        gc.freeze()
        yield
        ctx.engine.shutdown()
        shutdown_tracing()  # after the engines: every span of this process is flushed

    app = FastAPI(title="tinyserve", version=tinyserve.__version__, lifespan=lifespan)
    app.state.ctx = ctx
    app.state.metrics = metrics

    # ---- errors: always the endpoint's own format ----------------------------

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

    # ---- routes ------------------------------------------------------------------

    # The body types, checked against this server's field limits (field_limits.py).
    Chat, Completion, Responses, Messages, CountTokens, Tokenize = map(field_limits.bind, (
        ChatCompletionRequest, CompletionRequest, ResponsesRequest, MessagesRequest, MessagesCountTokensRequest,
        TokenizeRequest))
    responses = ResponseStore()
    server_load = ServerLoad(track_server_load)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: Chat, request: Request):
        return await create_chat_completion(ctx, body, request)

    @app.post("/v1/completions")
    async def completions(body: Completion, request: Request):
        return await create_completion(ctx, body, request)

    @app.post("/v1/responses")
    async def create_responses(body: Responses, request: Request):
        return await create_response(ctx, responses, body, request)

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: Annotated[str, Path(pattern=RESPONSE_ID_PATTERN)]):
        stored = responses.response(response_id)
        if stored is None:
            raise APIError(404, f"no stored response has the id {response_id!r}", "response_id")
        return stored

    @app.post("/v1/messages")
    async def messages(body: Messages, request: Request):
        return await create_message(ctx, body, request)

    @app.post("/v1/messages/count_tokens")
    async def messages_count_tokens(body: CountTokens):
        return await count_tokens(ctx, body)

    def model_card(name: str) -> dict:
        info = ctx.engine.model_info
        return {"id": name, "object": "model", "created": 0, "owned_by": "tinyserve", "root": str(info.path),
                "max_model_len": info.max_model_len}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card(name) for name in ctx.model_names]}

    @app.get("/v1/models/{model_id:path}")  # :path: a name may hold slashes ("org/model")
    async def model(model_id: str):
        ctx.check_model(model_id)
        return model_card(model_id)

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        return serving_tokenization.tokenizer_info(ctx)

    @app.get("/health")
    async def health():
        # vLLM answers an empty 200; a small JSON body says the same to someone with curl.
        if ctx.engine.is_healthy:
            return JSONResponse({"status": "ok"})
        reason = f"an engine died: {ctx.engine.dead_reason}" if ctx.engine.errored else "the engines are not running"
        return JSONResponse({"status": "unavailable", "reason": reason}, status_code=503)

    @app.get("/version")
    async def version():
        return {"version": tinyserve.__version__}

    @app.get("/load")
    async def load():
        # vLLM's: generation requests in flight, with --enable-server-load-tracking (else 0).
        return {"server_load": server_load.in_flight}

    @app.get("/metrics")
    async def prometheus_metrics():
        if ctx.engine.errored:  # a dead engine's load is no load (counters stay: they are history)
            metrics.forget_engine_gauges()
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/tokenize")
    async def tokenize(body: Tokenize):
        return await serving_tokenization.tokenize(ctx, body)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        return await serving_tokenization.detokenize(ctx, body)

    make_truthful(app, model_names=ctx.model_names, api_key=api_key is not None, field_limits=field_limits)

    # Added innermost first. The API key is checked before the HTTP span, so a refused client costs no span;
    # the span covers the rest, body limits included, for requests to a route that exists. The request id
    # is outermost: every answer carries it, a 401 too.
    post_routes = frozenset(route.path for route in app.routes if "POST" in getattr(route, "methods", ()))
    app.add_middleware(LoadReportsMiddleware, engine=ctx.engine, server_load=server_load)
    app.add_middleware(RequestLimitsMiddleware, max_body_bytes=max_request_body_bytes, json_paths=post_routes)
    app.add_middleware(TracingMiddleware, routes=app.router.routes)
    if api_key is not None:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)
    app.add_middleware(RequestIdMiddleware)
    return app
