"""The FastAPI app: routes, authentication, error bodies, health and metrics.

Handlers live in serving_chat.py (chat), serving_completion.py,
responses_serving.py, anthropic_serving.py and serving_tokenization.py (SageMaker's
/invocations, which picks chat or completions, in sagemaker_serving.py); this file wires
them to URLs, one group at a time (build_app), and makes sure that every failure, including a malformed body,
answers in the endpoint's own error format with a 4xx/5xx status, and never
with a traceback. A request passes, outermost first:

    RequestIdMiddleware      x-request-id on the response: the client's, or a new one
    HttpMetricsMiddleware    http_requests_total and the HTTP latencies of /metrics (http_metrics.py)
    ApiKeyMiddleware         401 on /v1 without the key (with --api-key)
    TracingMiddleware        the HTTP span, the root of the request's trace
    RequestLimitsMiddleware  415 for non-JSON, 413 for bodies over the limit
    LoadReportsMiddleware    ORCA load reports, the in-flight count of /load (load_reports.py)
    the route                pydantic validates the body (400), the handler runs
"""

import gc
import logging
from contextlib import asynccontextmanager
from typing import Annotated, NamedTuple

from fastapi import FastAPI, Path, Request
from fastapi.responses import JSONResponse, Response

import tinyserve
from tinyserve.entrypoints.api import serving_tokenization
from tinyserve.entrypoints.api.other_apis.anthropic_serving import (
    MessagesCountTokensRequest,
    MessagesRequest,
    count_tokens,
    create_message,
)
from tinyserve.entrypoints.api.guards.auth import ApiKeyMiddleware
from tinyserve.entrypoints.api.serving_completion import create_completion
from tinyserve.entrypoints.api.error_handlers import install_error_handlers
from tinyserve.entrypoints.api.errors import APIError
from tinyserve.entrypoints.api.guards.field_limits import FieldLimits
from tinyserve.entrypoints.api.guards.limits import DEFAULT_MAX_REQUEST_BODY_BYTES, RequestLimitsMiddleware
from tinyserve.entrypoints.api.guards.strict_body import with_ignored_fields
from tinyserve.entrypoints.api.load_reports import LoadReportsMiddleware, ServerLoad
from tinyserve.entrypoints.api.http_metrics import HttpMetricsMiddleware
from tinyserve.entrypoints.api.lora_metrics import lora_stat_loggers
from tinyserve.entrypoints.api.metrics import ServerMetrics
from tinyserve.entrypoints.api.openapi import make_truthful
from tinyserve.entrypoints.api.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from tinyserve.entrypoints.api.pooling_protocol import EmbeddingRequest, PoolingRequest
from tinyserve.entrypoints.api.serving_chat import create_chat_completion
from tinyserve.entrypoints.api.serving_embedding import create_embedding, create_pooling
from tinyserve.entrypoints.api.serving_engine import ServingContext
from tinyserve.entrypoints.api.request_ids import RequestIdMiddleware
from tinyserve.entrypoints.api.other_apis.responses_protocol import RESPONSE_ID_PATTERN, ResponsesRequest, ResponseStore
from tinyserve.entrypoints.api.other_apis.responses_serving import create_response
from tinyserve.entrypoints.api.other_apis.lora_serving import add_lora_routes, lora_model_cards
from tinyserve.entrypoints.api.other_apis.sagemaker_serving import add_invocations_route
from tinyserve.lifecycle.http_spans import TracingMiddleware
from tinyserve.lora.registry import runtime_lora_updating_allowed
from tinyserve.lifecycle.tracing import shutdown_tracing

logger = logging.getLogger("tinyserve.api")


def build_app(
    ctx: ServingContext,
    metrics: ServerMetrics,
    *,
    api_key: str | None = None,
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES,
    field_limits: FieldLimits = FieldLimits(),
    track_server_load: bool = False,
) -> FastAPI:
    """The app, assembled in the order a reader needs it: the routes (added in the order they are matched
    and listed in /openapi.json), their truthful schema, then the middleware around them."""
    app = FastAPI(title="tinyserve", version=tinyserve.__version__, lifespan=serving_lifespan(ctx, metrics))
    app.state.ctx = ctx
    app.state.metrics = metrics

    install_error_handlers(app, metrics)  # every error in the endpoint's own format (error_handlers.py)

    bodies = BodyTypes.bound(field_limits)
    server_load = ServerLoad(track_server_load)
    add_generation_routes(app, ctx, bodies)
    add_model_routes(app, ctx)
    add_status_routes(app, ctx, metrics, server_load)
    add_pooling_and_token_routes(app, ctx, bodies)
    add_invocations_route(app, ctx, bodies.chat, bodies.completion, bodies.embedding)  # sagemaker_serving.py
    make_schema_truthful(app, ctx, api_key=api_key, field_limits=field_limits)
    wrap_in_middleware(app, ctx, metrics, server_load, api_key=api_key, max_request_body_bytes=max_request_body_bytes)
    return app


def serving_lifespan(ctx: ServingContext, metrics: ServerMetrics):
    """The app's lifespan: the engines start (and report to the metrics) before the first request, and stop after
    the last one."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await ctx.engine.start()
        ctx.engine.stat_loggers.append(metrics)
        ctx.engine.stat_loggers += lora_stat_loggers(ctx, metrics)  # vllm:lora_requests_info, with adapters
        metrics.record_cache_config(ctx.engine.engine_args, ctx.engine.client.num_kv_blocks,
                                    ctx.engine.model_info.max_model_len)
        # What is loaded by now (torch, transformers, the app) lives as long as the server. Frozen,
        # it is no longer walked by every full garbage collection, each of which would stop the
        # event loop for a few hundred milliseconds (vLLM freezes its start-up heap too).
        gc.collect()
        gc.freeze()
        yield
        ctx.engine.shutdown()
        shutdown_tracing()  # after the engines: every span of this process is flushed

    return lifespan


class BodyTypes(NamedTuple):
    """The body types, checked against this server's field limits (field_limits.py)."""

    chat: type[ChatCompletionRequest]
    completion: type[CompletionRequest]
    responses: type[ResponsesRequest]
    messages: type[MessagesRequest]
    count_tokens: type[MessagesCountTokensRequest]
    tokenize: type[TokenizeRequest]
    embedding: type[EmbeddingRequest]
    pooling: type[PoolingRequest]

    @classmethod
    def bound(cls, field_limits: FieldLimits) -> "BodyTypes":
        return cls(*map(field_limits.bind, (
            ChatCompletionRequest, CompletionRequest, ResponsesRequest, MessagesRequest, MessagesCountTokensRequest,
            TokenizeRequest, EmbeddingRequest, PoolingRequest)))


# ---- routes ------------------------------------------------------------------


def add_generation_routes(app: FastAPI, ctx: ServingContext, bodies: BodyTypes) -> None:
    """The generating APIs: OpenAI's chat, completions and responses (with its stored answers), Anthropic's
    messages."""
    Chat, Completion, Responses = bodies.chat, bodies.completion, bodies.responses
    Messages, CountTokens = bodies.messages, bodies.count_tokens
    responses = ResponseStore()

    @app.post("/v1/chat/completions")
    async def chat_completions(body: Chat, request: Request):
        return with_ignored_fields(await create_chat_completion(ctx, body, request), body)

    @app.post("/v1/completions")
    async def completions(body: Completion, request: Request):
        return with_ignored_fields(await create_completion(ctx, body, request), body)

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


def add_model_routes(app: FastAPI, ctx: ServingContext) -> None:
    """What is served: the models (and LoRA adapters) by name, the adapters' own routes, the tokenizer."""

    def model_card(name: str) -> dict:
        info = ctx.engine.model_info
        return {"id": name, "object": "model", "created": 0, "owned_by": "tinyserve", "root": ctx.model_root,
                "max_model_len": info.max_model_len}

    @app.get("/v1/models")
    async def models():
        cards = [model_card(name) for name in ctx.model_names]
        return {"object": "list", "data": cards + lora_model_cards(ctx, cards[0])}

    @app.get("/v1/models/{model_id:path}")  # :path: a name may hold slashes ("org/model")
    async def model(model_id: str):
        ctx.check_model(model_id)
        adapter = [card for card in lora_model_cards(ctx, model_card(model_id)) if card["id"] == model_id]
        return adapter[0] if adapter else model_card(model_id)

    add_lora_routes(app, ctx)  # /v1/load_lora_adapter and /v1/unload_lora_adapter, when allowed

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        return serving_tokenization.tokenizer_info(ctx)


def add_status_routes(app: FastAPI, ctx: ServingContext, metrics: ServerMetrics, server_load: ServerLoad) -> None:
    """What a load balancer or a monitor asks: health (and SageMaker's ping), version, load, metrics."""

    @app.get("/health")
    async def health():
        # vLLM answers an empty 200; a small JSON body says the same to someone with curl. vLLM's 503 means
        # the engine client is dead (EngineDeadError): a data-parallel rank lost while others serve is not
        # that here (async_llm.py), so it stays 200, "degraded", naming the dead engines.
        if ctx.engine.is_healthy:
            if ctx.engine.dead_engines:
                return JSONResponse({"status": "degraded", "live_engines": ctx.engine.live_engine_indices,
                                     "dead_engines": {str(i): why for i, why in ctx.engine.dead_engines.items()}})
            return JSONResponse({"status": "ok"})
        reason = f"an engine died: {ctx.engine.dead_reason}" if ctx.engine.errored else "the engines are not running"
        return JSONResponse({"status": "unavailable", "reason": reason}, status_code=503)

    @app.api_route("/ping", methods=["GET", "POST"], include_in_schema=False)
    async def ping():
        # SageMaker's health check, vLLM's too: /health's answer.
        return await health()

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
        for engine_index in ctx.engine.dead_engines:  # a data-parallel rank lost while others serve
            metrics.forget_engine_gauges(engine_index)
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


def add_pooling_and_token_routes(app: FastAPI, ctx: ServingContext, bodies: BodyTypes) -> None:
    """--runner pooling (serving_embedding.py), then tokenize and detokenize. On a generating server, a pooling
    route answers a 400 saying what the model is served as; the generation routes answer a pooling server the
    same way (the input processor's check_runner)."""
    Embedding, Pooling, Tokenize = bodies.embedding, bodies.pooling, bodies.tokenize

    @app.post("/v1/embeddings")
    async def embeddings(body: Embedding, request: Request):
        return with_ignored_fields(await create_embedding(ctx, body, request), body)

    @app.post("/pooling")
    async def pooling(body: Pooling, request: Request):
        return with_ignored_fields(await create_pooling(ctx, body, request), body)

    @app.post("/tokenize")
    async def tokenize(body: Tokenize):
        return with_ignored_fields(await serving_tokenization.tokenize(ctx, body), body)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        return with_ignored_fields(await serving_tokenization.detokenize(ctx, body), body)


def make_schema_truthful(app: FastAPI, ctx: ServingContext, *, api_key: str | None,
                         field_limits: FieldLimits) -> None:
    """/openapi.json as this server answers: its model names, its key, its limits (openapi.py)."""
    # The names a request's model may take; None when LoRA adapters may be loaded at run time (any name may come).
    model_names = None if ctx.loras and runtime_lora_updating_allowed() else \
        ctx.model_names + (list(ctx.loras.adapters) if ctx.loras else [])
    make_truthful(app, model_names=model_names, api_key=api_key is not None, field_limits=field_limits,
                  vocab_size=getattr(getattr(ctx.engine, "model_info", None), "vocab_size", None),
                  auto_tool_choice=ctx.tool_call_parser is not None)


# ---- middleware ----------------------------------------------------------------


def wrap_in_middleware(app: FastAPI, ctx: ServingContext, metrics: ServerMetrics, server_load: ServerLoad, *,
                       api_key: str | None, max_request_body_bytes: int) -> None:
    """The layers of the module docstring, once every route exists (some layers are given the routes)."""
    # Added innermost first. The API key is checked before the HTTP span, so a refused client costs no span;
    # the span covers the rest, body limits included, for requests to a route that exists. The request id
    # is outermost: every answer carries it, a 401 too.
    post_routes = frozenset(route.path for route in app.routes if "POST" in getattr(route, "methods", ())
                            and route.path != "/ping")  # a POST /ping carries no body to check
    app.add_middleware(LoadReportsMiddleware, engine=ctx.engine, server_load=server_load)
    app.add_middleware(RequestLimitsMiddleware, max_body_bytes=max_request_body_bytes, json_paths=post_routes)
    app.add_middleware(TracingMiddleware, routes=app.router.routes)
    if api_key is not None:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)
    app.add_middleware(HttpMetricsMiddleware, http=metrics.http, routes=app.router.routes)  # a 401 counts too
    app.add_middleware(RequestIdMiddleware)
