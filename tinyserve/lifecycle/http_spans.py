"""The HTTP server span (the root of a request's trace) and tinyserve.respond.

A plain ASGI middleware, around everything the server does with a request but the
API-key check (a refused client costs nothing). It continues an incoming W3C
`traceparent` header, and watches the response bytes go out to build the respond
span: first byte sent → last byte sent.

The span is named after the route's template (`POST /v1/chat/completions`,
`GET /v1/models/{model}`), not the raw path, as OpenTelemetry's HTTP conventions
ask; a request that matches no route (404, 405) is not traced at all, so a scanner
probing paths cannot grow the trace files.
"""

import time

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode
from starlette.routing import Match

from tinyserve.lifecycle import schema
from tinyserve.lifecycle.tracing import extract_context, get_tracer, tracing_enabled


# Polled by load balancers and scrapers every few seconds: tracing them would bury the requests.
UNTRACED_PATHS = frozenset({"/health", "/metrics"})


class TracingMiddleware:
    def __init__(self, app, routes: list) -> None:
        """routes: the app's routes (Starlette's, each with `matches(scope)` and `path`), read at each request."""
        self.app = app
        self.routes = routes

    def _route_template(self, scope) -> str | None:
        for route in self.routes:
            match, _ = route.matches(scope)
            if match == Match.FULL:
                return route.path
        return None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not tracing_enabled() or scope["path"] in UNTRACED_PATHS:
            await self.app(scope, receive, send)
            return
        template = self._route_template(scope)
        if template is None:
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope.get("headers", [])}
        parent = extract_context({k: headers[k] for k in ("traceparent", "tracestate") if k in headers})
        method, path = scope["method"], scope["path"]
        tracer = get_tracer()
        span = tracer.start_span(f"{method} {template}", context=parent, kind=SpanKind.SERVER, attributes={
            "http.request.method": method, "http.route": template, "url.path": path,
            "url.scheme": scope.get("scheme", "http"), "server.port": (scope.get("server") or ("", 0))[1] or 0,
        })
        token = otel_context.attach(trace.set_span_in_context(span))
        response = {"status": 0, "first": None, "last": None, "chunks": 0, "bytes": 0, "streamed": False}

        async def traced_send(message) -> None:
            if message["type"] == "http.response.start":
                response["status"] = message["status"]
                response_headers = dict(message.get("headers", []))
                response["streamed"] = response_headers.get(b"content-type", b"").startswith(b"text/event-stream")
                report = response_headers.get(b"endpoint-load-metrics")
                if report is not None:  # what a load balancer was told about this server's load
                    span.set_attribute(schema.HTTP_RESPONSE_ORCA_REPORT, [report.decode("latin-1")])
            elif message["type"] == "http.response.body":
                now = time.time_ns()
                if response["first"] is None:
                    response["first"] = now
                response["chunks"] += 1
                response["bytes"] += len(message.get("body", b""))
                response["last"] = now
            await send(message)

        try:
            await self.app(scope, receive, traced_send)
        except Exception as error:
            span.record_exception(error)
            span.set_status(Status(StatusCode.ERROR, str(error)))
            raise
        finally:
            otel_context.detach(token)
            if response["first"] is not None:
                respond = tracer.start_span(schema.RESPOND, context=trace.set_span_in_context(span),
                                            start_time=response["first"], attributes={
                                                schema.RESPOND_CHUNKS: response["chunks"],
                                                schema.RESPOND_BYTES: response["bytes"],
                                                schema.STREAMED: response["streamed"],
                                            })
                respond.end(end_time=response["last"])
            span.set_attribute("http.response.status_code", response["status"])
            if response["status"] >= 500:
                span.set_status(Status(StatusCode.ERROR))
            span.end()
