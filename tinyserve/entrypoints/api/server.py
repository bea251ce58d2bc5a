"""The FastAPI app: routes, authentication, error bodies, health and metrics.

Handlers live in openai_serving.py and anthropic_serving.py; this file wires
them to URLs and makes sure that every failure, including a malformed body,
answers in the endpoint's own error format with a 4xx/5xx status.
"""

import hmac
import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

import tinyserve
from tinyserve.engine.core_client import EngineDeadError
from tinyserve.entrypoints.api.anthropic_serving import MessagesRequest, create_message
from tinyserve.entrypoints.api.errors import APIError, error_response, is_anthropic_path
from tinyserve.entrypoints.api.metrics import ServerMetrics
from tinyserve.entrypoints.api.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from tinyserve.entrypoints.api.openai_serving import ServingContext, create_chat_completion, create_completion
from tinyserve.lifecycle.http_spans import TracingMiddleware
from tinyserve.lifecycle.tracing import shutdown_tracing

logger = logging.getLogger("tinyserve.api")


def _validation_message(error: RequestValidationError) -> tuple[str, str | None]:
    first = error.errors()[0] if error.errors() else {}
    location = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = ".".join(location) or None
    message = first.get("msg", "invalid request body")
    return (f"{param}: {message}" if param else message), param


def build_app(ctx: ServingContext, metrics: ServerMetrics, *, api_key: str | None = None) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await ctx.engine.start()
        ctx.engine.stat_loggers.append(metrics)
        yield
        await ctx.engine.shutdown()
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
        return error_response(request.url.path, error.status_code, str(error.detail))

    @app.exception_handler(EngineDeadError)
    async def on_engine_dead(request: Request, error: EngineDeadError):
        return error_response(request.url.path, 503, f"the engine is not available: {error}")

    @app.exception_handler(ValueError)
    async def on_value_error(request: Request, error: ValueError):
        return error_response(request.url.path, 400, str(error))

    # ---- authentication: every /v1 route when --api-key is set ----------------

    if api_key is not None:
        expected = api_key.encode()

        @app.middleware("http")
        async def check_api_key(request: Request, call_next):
            if request.url.path.startswith("/v1"):
                given = request.headers.get("authorization", "")
                token = given[7:] if given.lower().startswith("bearer ") else ""
                if is_anthropic_path(request.url.path) and not token:
                    token = request.headers.get("x-api-key", "")
                # Constant-time comparison: the time taken says nothing about the key.
                if not hmac.compare_digest(token.encode(), expected):
                    return error_response(request.url.path, 401, "invalid or missing API key")
            return await call_next(request)

    # ---- routes ------------------------------------------------------------------

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await create_chat_completion(ctx, body, request)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await create_completion(ctx, body, request)

    @app.post("/v1/messages")
    async def messages(body: MessagesRequest, request: Request):
        return await create_message(ctx, body, request)

    @app.get("/v1/models")
    async def models():
        info = ctx.engine.model_info
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": 0, "owned_by": "tinyserve", "root": str(info.path),
             "max_model_len": info.max_model_len}
            for name in ctx.model_names
        ]}

    @app.get("/health")
    async def health():
        return Response(status_code=200 if ctx.engine.is_healthy else 503)

    @app.get("/version")
    async def version():
        return {"version": tinyserve.__version__}

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        ctx.check_model(body.model)
        engine = ctx.engine
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "send exactly one of 'prompt' or 'messages'")
        if body.messages is not None:
            text = engine.input_processor.render_chat([m.as_template_message() for m in body.messages])
            token_ids = engine.tokenizer.encode(text, add_special_tokens=False)
        else:
            token_ids = engine.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        return {"tokens": token_ids, "count": len(token_ids), "max_model_len": engine.model_info.max_model_len}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        ctx.check_model(body.model)
        vocab_size = ctx.engine.model_info.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab_size]
        if bad:
            raise APIError(400, f"tokens contains ids outside the vocabulary [0, {vocab_size}): {bad[:5]}", "tokens")
        return {"prompt": ctx.engine.tokenizer.decode(body.tokens)}

    # Outermost, so the HTTP span covers authentication and errors too.
    app.add_middleware(TracingMiddleware)
    return app
