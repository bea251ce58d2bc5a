"""The HTTP metrics of /metrics: every request counted and timed, as vLLM's are.

vLLM gets them from prometheus-fastapi-instrumentator; here prometheus-client's Counter and
Histogram hold the same series, under the same names and labels (no prefix):

    http_requests_total{method, status, handler}             status grouped: "2xx", "4xx", "5xx"
    http_request_duration_seconds{method, handler}           buckets 0.1, 0.5, 1 s (few: many labels)
    http_request_duration_highr_seconds                      21 buckets, 10 ms to 60 s, no labels

prometheus-client keeps the counts and the buckets and writes them out in the text format;
this module only decides what one request is worth. The probes (/metrics, /health, /load,
/version) are left out, as vLLM leaves them out.
"""

import time

from prometheus_client import CollectorRegistry, Counter, Histogram
from starlette.routing import Match

# prometheus-fastapi-instrumentator's default buckets, which vLLM's HTTP metrics keep.
HTTP_LATENCY_BUCKETS = (0.1, 0.5, 1)
HTTP_LATENCY_HIGHR_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1, 1.5, 2, 2.5, 3, 3.5, 4, 4.5, 5, 7.5,
                              10, 30, 60)
# Polled by load balancers, scrapers and health checks: vLLM's list of the handlers it does not measure.
UNMEASURED_HANDLERS = frozenset({"/metrics", "/health", "/load", "/ping", "/version", "/server_info"})
UNMATCHED_HANDLER = "none"  # the handler of a path no route matches: a scanner probing paths adds no series


class HttpMetrics:
    """The three series, in the server's registry."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter("http_requests_total", "Total number of requests by method, status and handler.",
                                ["method", "status", "handler"], registry=registry)
        self.duration = Histogram("http_request_duration_seconds", "Latency with only few buckets by handler, "
                                  "to the last byte sent.", ["method", "handler"], buckets=HTTP_LATENCY_BUCKETS,
                                  registry=registry)
        self.duration_highr = Histogram("http_request_duration_highr_seconds", "Latency with many buckets but no "
                                        "labels, to the last byte sent.", buckets=HTTP_LATENCY_HIGHR_BUCKETS,
                                        registry=registry)

    def observe(self, method: str, status: int, handler: str, duration: float) -> None:
        self.requests.labels(method, f"{str(status)[0]}xx", handler).inc()
        self.duration.labels(method, handler).observe(duration)
        self.duration_highr.observe(duration)


class HttpMetricsMiddleware:
    """Pure ASGI: counts each HTTP request and times it, from its arrival to the last byte of its answer.

    The `handler` label is the template of the route that matched (`/v1/models/{model_id:path}`,
    not each id). A request whose handler raised, answered 500 further out by Starlette's
    ServerErrorMiddleware, counts as "5xx". The answer's messages pass through untouched and at
    once: a stream is timed to its end, and a client that goes away ends the measure where the
    handler stops sending.
    """

    def __init__(self, app, *, http: HttpMetrics, routes: list) -> None:
        """routes: the app's routes (Starlette's, each with `matches(scope)` and `path`), read at each request."""
        self.app = app
        self.http = http
        self.routes = routes

    def _handler(self, scope) -> str:
        for route in self.routes:
            match, _ = route.matches(scope)
            if match == Match.FULL:
                return route.path
        return UNMATCHED_HANDLER

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        handler = self._handler(scope)
        if handler in UNMEASURED_HANDLERS:
            return await self.app(scope, receive, send)
        start = time.perf_counter()
        status = 500  # until an answer starts: a handler that raises is answered 500

        async def send_noting_status(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_noting_status)
        finally:
            self.http.observe(scope["method"], status, handler, time.perf_counter() - start)
