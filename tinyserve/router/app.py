"""The router's FastAPI app and its `Router`: choose a backend, forward, pass the answer back.

    POST /v1/chat/completions, /v1/completions   Router.dispatch: the policy's choice, then the proxy
    GET  /v1/models                               the first live backend's answer
    GET  /health                                  200 while any backend answers its /health, else 503

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

from tinyserve.entrypoints.api.errors import openai_error_body
from tinyserve.entrypoints.api.load_reports import FORMAT_HEADER, REPORT_HEADER
from tinyserve.lifecycle import schema
from tinyserve.lifecycle.http_spans import TracingMiddleware
from tinyserve.lifecycle.tracing import get_tracer, inject_context, shutdown_tracing
from tinyserve.router.backends import Backend
from tinyserve.router.policies import Choice, RoutedRequest
from tinyserve.router.proxy import BackendFailed, BackendUnreachable, forwarded_headers, open_response, pass_back

logger = logging.getLogger("tinyserve.router")

HEALTH_TIMEOUT_S = 2.0
# No read timeout: a long generation streams for as long as it needs. Connecting is bounded.
CLIENT_TIMEOUT = httpx.Timeout(None, connect=5.0)


class Router:
    """Backends and a policy; `dispatch` handles one generation request."""

    def __init__(self, backends: list[Backend], policy) -> None:
        self.backends = backends
        self.policy = policy
        self.client: httpx.AsyncClient | None = None  # made in the app's event loop (start)

    async def start(self) -> None:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        self.client = httpx.AsyncClient(timeout=CLIENT_TIMEOUT, limits=limits)
        start = getattr(self.policy, "start", None)
        if start is not None:
            await start()

    async def stop(self) -> None:
        stop = getattr(self.policy, "stop", None)
        if stop is not None:
            await stop()
        if self.client is not None:
            await self.client.aclose()

    async def dispatch(self, request: Request) -> Response:
        """Choose a live backend, forward, pass the answer back; the next choice if one cannot be reached."""
        body = await request.body()
        routed = RoutedRequest(request.url.path, _json_object(body))
        unreachable: list[str] = []
        while live := [b for b in self.backends if b.is_up() and b.url not in unreachable]:
            choice = await self.policy.choose(routed, live)
            span = _route_span(self.policy.name, choice)
            headers = forwarded_headers(request.headers, inject_context(trace.set_span_in_context(span)))
            choice.backend.in_flight += 1
            choice.backend.routed += 1
            self.policy.forwarded(routed, choice)  # before the answer: the next request may come meanwhile
            try:
                response = await open_response(self.client, choice.backend, "POST", request.url.path, body, headers)
            except (BackendUnreachable, BackendFailed) as error:
                choice.backend.in_flight -= 1
                _end(span, 502, str(error))
                if isinstance(error, BackendFailed):
                    return _error(502, str(error))
                unreachable.append(choice.backend.url)
                continue
            except BaseException:  # cancelled: the client left before the answer began
                choice.backend.in_flight -= 1
                _end(span, 499, "the client left before the answer began")
                raise
            choice.backend.read_orca(response.headers.get(REPORT_HEADER))
            return pass_back(response, FORMAT_HEADER in request.headers,
                             on_close=lambda b=choice.backend, s=span, r=response: _finished(b, s, r.status_code))
        return _error(503, _none_available(self.backends, unreachable))

    async def get_from_any(self, path: str) -> Response:
        """A GET the backends all answer alike (/v1/models): the first live one's answer."""
        for backend in [b for b in self.backends if b.is_up()]:
            try:
                answer = await self.client.get(backend.url + path, timeout=HEALTH_TIMEOUT_S * 5)
            except httpx.HTTPError as error:
                backend.mark_down(f"{type(error).__name__}: {error}")
                continue
            return Response(answer.content, status_code=answer.status_code,
                            media_type=answer.headers.get("content-type"))
        return _error(503, _none_available(self.backends, []))

    async def health(self) -> Response:
        async def check(backend: Backend) -> dict:
            try:
                answer = await self.client.get(backend.url + "/health", timeout=HEALTH_TIMEOUT_S)
                return {"url": backend.url, "status": answer.status_code}
            except httpx.HTTPError as error:
                return {"url": backend.url, "status": None, "error": f"{type(error).__name__}: {error}"}

        states = await asyncio.gather(*(check(backend) for backend in self.backends))
        healthy = any(state["status"] == 200 for state in states)
        return JSONResponse({"status": "ok" if healthy else "no backend is healthy", "backends": states},
                            status_code=200 if healthy else 503)


def _route_span(policy: str, choice: Choice):
    return get_tracer().start_span(schema.ROUTE, kind=SpanKind.CLIENT, attributes={
        schema.ROUTER_POLICY: policy, schema.ROUTER_BACKEND: choice.backend.url,
        schema.ROUTER_BACKEND_INDEX: choice.backend.index, schema.ROUTER_REASON: choice.reason,
        schema.ROUTER_BACKEND_IN_FLIGHT: choice.backend.in_flight, **choice.attributes})


def _finished(backend: Backend, span, status: int) -> None:
    backend.in_flight -= 1
    _end(span, status)


def _end(span, status: int, error: str | None = None) -> None:
    span.set_attribute("http.response.status_code", status)
    if error is not None or status >= 500:
        span.set_status(Status(StatusCode.ERROR, error))
    span.end()


def _json_object(body: bytes) -> dict:
    """The body as a JSON object for the policy to read; {} for anything else (the backend says what is wrong)."""
    try:
        value = json.loads(body)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _none_available(backends: list[Backend], unreachable: list[str]) -> str:
    reasons = "; ".join(f"{b.url}: {b.last_error or 'down'}" for b in backends if not b.is_up() or b.url in unreachable)
    return f"no backend is available to take the request ({reasons})"


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse(openai_error_body(status, message), status_code=status)


def build_app(router: Router) -> FastAPI:
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

    app.add_middleware(TracingMiddleware, routes=app.router.routes)
    return app
