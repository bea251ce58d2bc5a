"""The router's FastAPI app and its `Router`: choose a backend, forward, pass the answer back.

    POST /v1/chat/completions, /v1/completions   Router.dispatch: the policy's choice, then the proxy
    GET  /v1/models                               the first live backend's answer (at most 8 MiB of it)
    GET  /health                                  200 while a request can be served (health.py), else 503 naming why

A request passes the server's own guards first: its body within --max-request-body-bytes (413
naming the limit, before anything reads it whole), its headers and body within
--http-header-timeout and --http-body-timeout (408). The router then reads the body as JSON; one that
is not a JSON object is a 400, and so is one that sets kv_transfer_params: those are the router's to
send (prefill/decode, pd.py), and a client's would point a decode server at any host it names.

Every proxied request is traced when tracing is on: the HTTP server span (lifecycle/http_spans.py,
as the server's), and under it `tinyserve.route`, from the choice to the answer's last byte, with
the policy, the backend and the policy's reason. Its context goes to the backend as `traceparent`,
so the backend's spans join the same trace.
"""

import asyncio
import json
import logging
from contextlib import asynccontextmanager

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from tinyserve.entrypoints.api.defaults import DEFAULT_MAX_REQUEST_BODY_BYTES
from tinyserve.entrypoints.api.errors import openai_error_body
from tinyserve.entrypoints.api.guards.limits import RequestLimitsMiddleware
from tinyserve.entrypoints.api.load_reports import FORMAT_HEADER, REPORT_HEADER
from tinyserve.lifecycle import schema
from tinyserve.lifecycle.http_spans import TracingMiddleware
from tinyserve.lifecycle.tracing import get_tracer, inject_context, shutdown_tracing
from tinyserve.router.backends import Backend
from tinyserve.router.defaults import DEFAULT_BACKEND_HEADER_TIMEOUT_S, MAX_BACKEND_ANSWER_BYTES
from tinyserve.router.health import HealthChecks, watch
from tinyserve.router.policies import Choice, RoutedRequest
from tinyserve.router.proxy import (
    AnswerTooLarge,
    BackendFailed,
    BackendUnreachable,
    forwarded_headers,
    open_response,
    pass_back,
    read_bounded,
)

logger = logging.getLogger("tinyserve.router")

MODELS_TIMEOUT_S = 10.0  # GET /v1/models, whole
# No read timeout: a long generation streams for as long as it needs. Connecting is bounded, and the
# wait for an answer's status line and headers (--backend-header-timeout, open_response).
CLIENT_TIMEOUT = httpx.Timeout(None, connect=5.0)
GENERATION_PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})


class Router:
    """Backends and a policy; `dispatch` handles one generation request."""

    def __init__(self, backends: list[Backend], policy, health: HealthChecks = HealthChecks(),
                 header_timeout_s: float = DEFAULT_BACKEND_HEADER_TIMEOUT_S) -> None:
        self.backends = backends
        self.policy = policy
        self.health_checks = health
        self.header_timeout_s = header_timeout_s
        self.client: httpx.AsyncClient | None = None  # made in the app's event loop (start)
        self._watching: asyncio.Task | None = None

    async def start(self) -> None:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        self.client = httpx.AsyncClient(timeout=CLIENT_TIMEOUT, limits=limits)
        start = getattr(self.policy, "start", None)
        if start is not None:
            await start()
        self._watching = asyncio.create_task(watch(self.client, self.backends, self.health_checks),
                                             name="health-checks")

    async def stop(self) -> None:
        if self._watching is not None:
            self._watching.cancel()
            await asyncio.gather(self._watching, return_exceptions=True)
        stop = getattr(self.policy, "stop", None)
        if stop is not None:
            await stop()
        if self.client is not None:
            await self.client.aclose()

    async def dispatch(self, request: Request) -> Response:
        """Choose a live backend, forward, pass the answer back; the next choice if one cannot be reached."""
        body = await request.body()
        parsed = request_object(body)
        if not isinstance(parsed, dict):
            return parsed
        routed = RoutedRequest(request.url.path, parsed)
        unreachable: list[str] = []
        while live := [b for b in self.backends if b.is_up() and b.url not in unreachable]:
            choice = await self.policy.choose(routed, live)
            span = _route_span(self.policy.name, choice)
            headers = forwarded_headers(request.headers, inject_context(trace.set_span_in_context(span)))
            choice.backend.in_flight += 1
            choice.backend.routed += 1
            self.policy.forwarded(routed, choice)  # before the answer: the next request may come meanwhile
            try:
                response = await open_response(self.client, choice.backend, "POST", request.url.path, body, headers,
                                               self.header_timeout_s)
            except (BackendUnreachable, BackendFailed) as error:
                choice.backend.in_flight -= 1
                status = error.status if isinstance(error, BackendFailed) else 502
                _end(span, status, str(error))
                if isinstance(error, BackendFailed):
                    return _error(status, str(error))
                unreachable.append(choice.backend.url)
                continue
            except BaseException:  # cancelled: the client left before the answer began
                choice.backend.in_flight -= 1
                _end(span, 499, "the client left before the answer began")
                raise
            choice.backend.read_orca(response.headers.get(REPORT_HEADER))
            return pass_back(response, choice.backend, FORMAT_HEADER in request.headers,
                             on_close=lambda error, b=choice.backend, s=span, r=response:
                             _finished(b, s, r.status_code, error))
        return _error(503, _none_available(self.backends, unreachable))

    async def get_from_any(self, path: str) -> Response:
        """A GET the backends all answer alike (/v1/models): the first live one's answer, read whole within
        MODELS_TIMEOUT_S and MAX_BACKEND_ANSWER_BYTES."""
        for backend in [b for b in self.backends if b.is_up()]:
            async def get() -> tuple[int, bytes, str | None]:
                async with self.client.stream("GET", backend.url + path) as answer:
                    content = await read_bounded(answer, MAX_BACKEND_ANSWER_BYTES, f"{backend.url}{path}'s answer")
                    return answer.status_code, content, answer.headers.get("content-type")

            try:
                status, content, media_type = await asyncio.wait_for(get(), MODELS_TIMEOUT_S)
            except asyncio.TimeoutError:
                backend.mark_down(f"no whole answer to GET {path} within {MODELS_TIMEOUT_S:g} s")
                continue
            except AnswerTooLarge as error:
                logger.warning("%s", error)
                return _error(502, str(error))
            except httpx.HTTPError as error:
                backend.mark_down(f"{type(error).__name__}: {error}")
                continue
            return Response(content, status_code=status, media_type=media_type)
        return _error(503, _none_available(self.backends, []))

    def unavailable(self) -> str | None:
        """Why no request can be served now (None while one can): here, when no backend is up."""
        return None if any(b.is_up() for b in self.backends) else _none_available(self.backends, [])

    async def health(self) -> Response:
        """Each backend's state as the health checks and the requests left it; no backend is asked."""
        states = [{"url": b.url, "up": b.is_up(), **({} if b.is_up() else {"error": b.last_error})}
                  for b in self.backends]
        why_not = self.unavailable()
        body = {"status": why_not or "ok", "backends": states}
        return JSONResponse(body, status_code=200 if why_not is None else 503)


def _route_span(policy: str, choice: Choice):
    return get_tracer().start_span(schema.ROUTE, kind=SpanKind.CLIENT, attributes={
        schema.ROUTER_POLICY: policy, schema.ROUTER_BACKEND: choice.backend.url,
        schema.ROUTER_BACKEND_INDEX: choice.backend.index, schema.ROUTER_REASON: choice.reason,
        schema.ROUTER_BACKEND_IN_FLIGHT: choice.backend.in_flight, **choice.attributes})


def _finished(backend: Backend, span, status: int, error: str | None = None) -> None:
    backend.in_flight -= 1
    _end(span, 502 if error else status, error)


def _end(span, status: int, error: str | None = None) -> None:
    span.set_attribute("http.response.status_code", status)
    if error is not None or status >= 500:
        span.set_status(Status(StatusCode.ERROR, error))
    span.end()


def request_object(body: bytes) -> dict | JSONResponse:
    """The body as the JSON object the policy reads and the backend gets, or the client's 400 saying why not."""
    try:
        value = json.loads(body)
    except RecursionError:
        return _error(400, "the request body is not valid JSON: it is nested too deeply")
    except ValueError as error:
        return _error(400, f"the request body is not valid JSON: {error}")
    if not isinstance(value, dict):
        return _error(400, "the request body must be a JSON object")
    if "kv_transfer_params" in value:
        return _error(400, "kv_transfer_params is set by the router (prefill/decode), never by a client: "
                           "remove it from the request", param="kv_transfer_params")
    return value


def _none_available(backends: list[Backend], unreachable: list[str]) -> str:
    reasons = "; ".join(f"{b.url}: {b.last_error or 'down'}" for b in backends if not b.is_up() or b.url in unreachable)
    return f"no backend is available to take the request ({reasons})"


def _error(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(openai_error_body(status, message, param), status_code=status)


def build_app(router: Router, max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES) -> FastAPI:
    """The router's app. `router` is anything with start, stop, dispatch, get_from_any and health."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await router.start()
        try:
            yield
        finally:
            await router.stop()
            shutdown_tracing()

    app = FastAPI(title="tinyserve router", lifespan=lifespan)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await router.dispatch(request)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await router.dispatch(request)

    @app.get("/v1/models")
    async def models() -> Response:
        return await router.get_from_any("/v1/models")

    @app.get("/health")
    async def health() -> Response:
        return await router.health()

    # The server's body guard (entrypoints/api/guards/limits.py), inside the HTTP span: a 413 is traced too.
    app.add_middleware(RequestLimitsMiddleware, max_body_bytes=max_request_body_bytes, json_paths=GENERATION_PATHS)
    app.add_middleware(TracingMiddleware, routes=app.router.routes)
    return app
