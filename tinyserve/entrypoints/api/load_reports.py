"""What a load balancer in front of the server can learn of its load, told as vLLM tells it.

ORCA load reports (Open Request Cost Aggregation, read by Envoy and the gateways
built on it). A request that carries

    endpoint-load-metrics-format: text        (or json; either case)

gets, with a successful non-streaming /v1/chat/completions or /v1/completions
answer, the response header

    endpoint-load-metrics: TEXT named_metrics.kv_cache_usage_perc=0.25, named_metrics.num_requests_waiting=3.0
    endpoint-load-metrics: JSON {"named_metrics": {"kv_cache_usage_perc": 0.25, "num_requests_waiting": 3.0}}

the two gauges of /metrics, from the engines' latest scheduler stats, as doubles.
No format asked, no header; a format other than those two gets none either, and a
warning in the log. Streams and errors carry none. This is vLLM's
vllm/entrypoints/openai/orca_metrics.py (metrics_header), route for route. vLLM
reads its first engine's gauges; a server here with several engines reports them
all together (waiting requests summed, KV usage averaged), the same figure for the
one engine of a --data-parallel-rank server.

Server load (--enable-server-load-tracking, vLLM's): GET /load answers
{"server_load": N}, the generation requests (chat, completions, responses,
messages, invocations) in flight now, each counted once past the body checks until the last
byte of its answer is sent or its client goes. Without the flag /load answers 0.
"""

import json
import logging

from tinyserve.wire.messages import SchedulerStats

logger = logging.getLogger("tinyserve.api")

FORMAT_HEADER = "endpoint-load-metrics-format"
REPORT_HEADER = "endpoint-load-metrics"
ORCA_PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})
TRACKED_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages",
                           "/invocations"})


def named_metrics(engine_stats: list[SchedulerStats]) -> list[tuple[str, float]]:
    """vLLM's two ORCA metrics over these engines' latest stats (an engine yet to report counts as idle)."""
    usage = sum(stats.kv_cache_usage for stats in engine_stats) / len(engine_stats) if engine_stats else 0.0
    waiting = sum(stats.num_waiting_reqs for stats in engine_stats)
    return [("kv_cache_usage_perc", float(usage)), ("num_requests_waiting", float(waiting))]


def orca_header(metrics_format: str, metrics: list[tuple[str, float]]) -> str | None:
    """The endpoint-load-metrics value for this format, or None (no format asked, or one not known)."""
    if not metrics_format:
        return None
    if metrics_format.lower() == "text":
        return "TEXT " + ", ".join(f"named_metrics.{name}={value}" for name, value in metrics)
    if metrics_format.lower() == "json":
        return "JSON " + json.dumps({"named_metrics": dict(metrics)})
    logger.warning("%s: %r is not a format of the ORCA load report (text or json); none sent",
                   FORMAT_HEADER, metrics_format)
    return None


class ServerLoad:
    """The generation requests in flight, for GET /load (stays 0 unless tracking is on)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.in_flight = 0


class LoadReportsMiddleware:
    """Pure ASGI: counts the tracked requests while they run, and adds the ORCA header where it was asked for."""

    def __init__(self, app, *, engine, server_load: ServerLoad) -> None:
        self.app = app
        self.engine = engine  # the AsyncLLM: engine_indices and engine_stats
        self.server_load = server_load

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            return await self.app(scope, receive, send)
        path = scope["path"]
        if path in ORCA_PATHS:
            send = self._reporting(scope, send)
        if not (self.server_load.enabled and path in TRACKED_PATHS):
            return await self.app(scope, receive, send)
        self.server_load.in_flight += 1
        try:
            await self.app(scope, receive, send)  # returns once the answer is sent, or the client is gone
        finally:
            self.server_load.in_flight -= 1

    def _reporting(self, scope, send):
        metrics_format = dict(scope["headers"]).get(FORMAT_HEADER.encode(), b"").decode("latin-1")
        if not metrics_format:
            return send

        async def send_with_report(message) -> None:
            if message["type"] == "http.response.start" and message["status"] == 200 and _is_json(message):
                # The values as the answer leaves, as vLLM reads them when it builds its JSONResponse.
                stats = [self.engine.engine_stats.get(i, SchedulerStats()) for i in self.engine.engine_indices]
                value = orca_header(metrics_format, named_metrics(stats))
                if value is not None:
                    message = {**message, "headers": [*message.get("headers", []),
                                                      (REPORT_HEADER.encode(), value.encode("latin-1"))]}
            await send(message)

        return send_with_report


def _is_json(start_message) -> bool:
    """A whole JSON answer, not an event stream: only those carry the report, as in vLLM."""
    content_type = dict(start_message.get("headers", [])).get(b"content-type", b"")
    return content_type.startswith(b"application/json")
