"""Prometheus metrics with vLLM's names and definitions, under the `tinyserve:` prefix.

Two clocks, never mixed (the API process and each engine have their own):
- front-end clock (this process): arrival → each token received → finish gives
  TTFT, inter-token latency, time per output token and end-to-end latency;
- engine clock (reported when a request finishes): queued → first scheduled →
  first token → finished gives queue, prefill and decode time.
"""

import time
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from tinyserve.wire.messages import EngineCoreOutputs, EngineCoreRequest

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0)


@dataclass(slots=True)
class _RequestClock:
    arrival_time: float
    num_prompt_tokens: int
    first_token_time: float | None = None
    last_token_time: float | None = None
    num_generated: int = 0


@dataclass
class _EngineCounters:
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0


class ServerMetrics:
    def __init__(self, model_name: str, num_engines: int) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        labels = ["model_name", "engine"]

        def gauge(name, doc):
            return Gauge(f"tinyserve:{name}", doc, labels, registry=self.registry)

        def counter(name, doc, extra=()):
            return Counter(f"tinyserve:{name}", doc, labels + list(extra), registry=self.registry)

        def histogram(name, doc, buckets):
            return Histogram(f"tinyserve:{name}", doc, labels, buckets=buckets, registry=self.registry)

        self.num_requests_running = gauge("num_requests_running", "Requests in the engine's running set.")
        self.num_requests_waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_cache_usage_perc = gauge("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full).")
        self.prefix_cache_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_cache_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.num_preemptions = counter("num_preemptions", "Requests preempted by the scheduler.")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of requests that reached their first token.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        self.request_success = counter("request_success", "Finished requests, by finish reason.", ["finished_reason"])
        self.time_to_first_token = histogram("time_to_first_token_seconds", "Arrival to first token.", _LATENCY_BUCKETS)
        self.inter_token_latency = histogram("inter_token_latency_seconds", "Time between two output tokens.", _LATENCY_BUCKETS)
        self.time_per_output_token = histogram(
            "request_time_per_output_token_seconds", "(e2e - TTFT) / (output tokens - 1), per request.", _LATENCY_BUCKETS
        )
        self.e2e_latency = histogram("e2e_request_latency_seconds", "Arrival to finish.", _REQUEST_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds", "Engine: queued to first scheduled.", _REQUEST_BUCKETS)
        self.prefill_time = histogram("request_prefill_time_seconds", "Engine: first scheduled to first token.", _REQUEST_BUCKETS)
        self.decode_time = histogram("request_decode_time_seconds", "Engine: first token to finish.", _REQUEST_BUCKETS)
        self._clocks: dict[str, _RequestClock] = {}
        self._counters = {i: _EngineCounters() for i in range(num_engines)}
        for engine in range(num_engines):  # make every series visible from the start
            for metric in (self.num_requests_running, self.num_requests_waiting, self.kv_cache_usage_perc):
                metric.labels(model_name, str(engine)).set(0)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def forget_engine_gauges(self) -> None:
        """The engines are gone: their gauges go too, rather than stand at the last values they reported."""
        for metric in (self.num_requests_running, self.num_requests_waiting, self.kv_cache_usage_perc):
            metric.clear()

    def on_request(self, request: EngineCoreRequest) -> None:
        self._clocks[request.request_id] = _RequestClock(request.arrival_time, len(request.prompt_token_ids))

    def on_outputs(self, outputs: EngineCoreOutputs, received_time: float | None = None) -> None:
        now = received_time or time.time()
        engine = str(outputs.engine_index)
        labels = (self.model_name, engine)
        stats = outputs.scheduler_stats
        if stats is not None:
            self.num_requests_running.labels(*labels).set(stats.num_running_reqs)
            self.num_requests_waiting.labels(*labels).set(stats.num_waiting_reqs)
            self.kv_cache_usage_perc.labels(*labels).set(stats.kv_cache_usage)
            seen = self._counters.setdefault(outputs.engine_index, _EngineCounters())
            # The engine reports running totals; Prometheus counters want increments.
            self.prefix_cache_queries.labels(*labels).inc(stats.prefix_cache_queries - seen.prefix_cache_queries)
            self.prefix_cache_hits.labels(*labels).inc(stats.prefix_cache_hits - seen.prefix_cache_hits)
            self.num_preemptions.labels(*labels).inc(stats.num_preemptions - seen.num_preemptions)
            seen.prefix_cache_queries, seen.prefix_cache_hits = stats.prefix_cache_queries, stats.prefix_cache_hits
            seen.num_preemptions = stats.num_preemptions
        for output in outputs.outputs:
            clock = self._clocks.get(output.request_id)
            if clock is None:
                continue
            if output.new_token_ids:
                self.generation_tokens.labels(*labels).inc(len(output.new_token_ids))
                if clock.first_token_time is None:
                    clock.first_token_time = now
                    self.prompt_tokens.labels(*labels).inc(clock.num_prompt_tokens)
                    self.time_to_first_token.labels(*labels).observe(now - clock.arrival_time)
                else:
                    self.inter_token_latency.labels(*labels).observe(now - clock.last_token_time)
                clock.last_token_time = now
                clock.num_generated += len(output.new_token_ids)
            if output.finished:
                self._finish(output, clock, now, labels)

    def _finish(self, output, clock: _RequestClock, now: float, labels) -> None:
        del self._clocks[output.request_id]
        self.request_success.labels(*labels, output.finish_reason).inc()
        self.e2e_latency.labels(*labels).observe(now - clock.arrival_time)
        if clock.first_token_time is not None and clock.num_generated > 1:
            tpot = (now - clock.first_token_time) / (clock.num_generated - 1)
            self.time_per_output_token.labels(*labels).observe(tpot)
        times = output.times
        if times is None or times.first_scheduled_time is None:
            return
        self.queue_time.labels(*labels).observe(times.first_scheduled_time - times.queued_time)
        if times.first_token_time is not None:
            self.prefill_time.labels(*labels).observe(times.first_token_time - times.first_scheduled_time)
            if times.finished_time is not None:
                self.decode_time.labels(*labels).observe(times.finished_time - times.first_token_time)
