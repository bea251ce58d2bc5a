"""Prometheus metrics with vLLM's names, definitions and buckets, under the `tinyserve:` prefix (or another).

`--metrics-prefix vllm` names them `vllm:...` as vLLM does (same names, same labels), for vLLM's
dashboards and alerts; the HTTP metrics (http_metrics.py) carry no prefix, as vLLM's do.

Two clocks, never mixed (the API process and each engine have their own):
- front-end clock (this process): arrival → each token received → finish gives
  TTFT, inter-token latency, time per output token and end-to-end latency;
- engine clock (reported when a request finishes): queued → first scheduled →
  first token → finished gives queue, prefill, decode and inference (running) time.

Waiting requests are split as vLLM splits them (`num_requests_waiting_by_reason`): "deferred"
ones cannot be scheduled yet whatever the room (here: their structured-output grammar is still
being compiled), "capacity" ones wait for a seat, token budget or KV blocks. tinyserve has no
other reason to defer a request (no LoRA budget, no KV transfer).

A request is counted as finished with the finish its client got. One that ended on a
stop string is finished by the front end (the output processor marks the engine's
output "stop"); the engine then reports it aborted, with its timestamps, and only those
timestamps are taken from that report. An `n > 1` request is one parent of n engine
requests: `request_params_n` and `request_max_num_generation_tokens` are observed once
its last child finishes, the per-request token histograms once per child, as in vLLM.

With several API processes (`--api-server-count N`) each keeps its own series in
prometheus-client's multiprocess mode (files in PROMETHEUS_MULTIPROC_DIR, which the main
process makes), and /metrics, whichever process answers it, reads them all, as vLLM's
does: counters and histograms are summed over the processes; the engines' gauges, which
every process sets from the same engine reports, are the most recent value set
(multiprocess_mode "mostrecent"); the engines' running totals (prefix cache, preemptions,
speculative decoding) are counted by API process 0 alone, since every process reads the
same reports. Each process's iteration_tokens_total observes its own requests' share of
an engine step, as each of vLLM's API servers does. The process_* series describe one
process and are left out.

The module is over 300 lines because vLLM's metric set, each metric with its help text and
labels, reads best in one place (speculative decoding's own counters: spec_decode/metrics.py).
"""

import contextlib
import functools
import time
from collections.abc import Sequence
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector

from tinyserve.entrypoints.api.defaults import DEFAULT_METRICS_PREFIX  # the CLI shows it too
from tinyserve.entrypoints.api.http_metrics import HttpMetrics
from tinyserve.spec_decode.metrics import SpecDecodeCounters
from tinyserve.wire.messages import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, RequestTimes
from tinyserve.sampling_params import SamplingParams

# vLLM's buckets (vllm/v1/metrics/loggers.py).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                         20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 7680.0)
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
N_BUCKETS = (1, 2, 5, 10, 20)
PREEMPTION_BUCKETS = (1, 2, 3, 4, 5, 10, 20)

WAITING_REASON_CAPACITY = "capacity"  # vLLM's reasons (vllm/v1/metrics/loggers.py)
WAITING_REASON_DEFERRED = "deferred"
ENGINE_LABELS = ("model_name", "engine")  # the labels of every engine metric, in vLLM's order


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (vLLM's buckets for token counts, up to max_model_len)."""
    buckets, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return buckets
            buckets.append(mantissa * scale)
        scale *= 10


@dataclass(slots=True)
class _RequestClock:
    parent_id: str
    arrival_time: float
    num_prompt_tokens: int
    max_tokens: int | None
    first_token_time: float | None = None
    last_token_time: float | None = None
    num_generated: int = 0


@dataclass(slots=True)
class _Parent:
    n: int
    num_unfinished: int
    max_num_generated: int = 0


@dataclass
class _EngineCounters:
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    mm_cache_queries: int = 0
    mm_cache_hits: int = 0


class ServerMetrics:
    def __init__(self, model_name: str, engine_indices: Sequence[int], max_model_len: int,
                 prefix: str = DEFAULT_METRICS_PREFIX, api_server_index: int | None = None) -> None:
        """engine_indices: the `engine` label of each engine (0..N-1, or R alone with --data-parallel-rank R).
        prefix: what names start with, before the colon (`vllm` gives vLLM's names).
        api_server_index: this process's index among several API processes (multiprocess mode); None: alone."""
        self.registry = CollectorRegistry()
        self.multiprocess = api_server_index is not None
        self.counts_engine_totals = api_server_index in (None, 0)
        if not self.multiprocess:
            ProcessCollector(registry=self.registry)  # process_cpu_seconds_total, process_resident_memory_bytes, ...
        self.model_name = model_name
        self.engine_indices = list(engine_indices)
        self.prefix = prefix
        # Registered in this order, which is the order /metrics lists them in.
        self._add_scheduler_gauges()
        self._add_counters()
        self._add_request_histograms(build_1_2_5_buckets(max_model_len))
        self._add_latency_histograms()
        # Requests the server failed (a 500, its traceback in the server log), by path: a bad request is a 4xx
        # and is not counted here, so that monitoring sees the server's own faults.
        self.server_errors = Counter(f"{prefix}:server_errors", "Requests answered 500 (internal errors), by path.",
                                     ["path"], registry=self.registry)
        self.http = HttpMetrics(self.registry)  # filled by http_metrics.HttpMetricsMiddleware
        self.cache_config_info = None  # set once the engines report their KV pools (record_cache_config)
        self.spec_decode = SpecDecodeCounters(prefix, self.registry, ENGINE_LABELS)  # registered once used
        self._clocks: dict[str, _RequestClock] = {}
        self._parents: dict[str, _Parent] = {}
        self._awaiting_engine_times: dict[str, tuple] = {}  # finished here on a stop string: id → labels
        self._counters = {i: _EngineCounters() for i in self.engine_indices}
        self._zero_scheduler_gauges()

    # ---- the metric families, by group (each labelled model_name, engine) ------------------------------

    def _gauge(self, name: str, doc: str, extra=()) -> Gauge:
        return Gauge(f"{self.prefix}:{name}", doc, [*ENGINE_LABELS, *extra], registry=self.registry,
                     multiprocess_mode="mostrecent")

    def _counter(self, name: str, doc: str, extra=()) -> Counter:
        return Counter(f"{self.prefix}:{name}", doc, [*ENGINE_LABELS, *extra], registry=self.registry)

    def _histogram(self, name: str, doc: str, buckets) -> Histogram:
        return Histogram(f"{self.prefix}:{name}", doc, list(ENGINE_LABELS), buckets=buckets, registry=self.registry)

    def _add_scheduler_gauges(self) -> None:
        """What each engine's scheduler reports with every step: its queues and its KV cache's fill."""
        gauge = self._gauge
        self.num_requests_running = gauge("num_requests_running", "Requests in the engine's running set.")
        self.num_requests_waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.num_requests_waiting_by_reason = gauge(
            "num_requests_waiting_by_reason", "Waiting requests by reason: 'capacity' = waiting for room to be "
            "scheduled; 'deferred' = not schedulable yet (structured-output grammar still compiling). The reasons "
            "sum to num_requests_waiting.", ["reason"])
        self.kv_cache_usage_perc = gauge("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full).")

    def _add_counters(self) -> None:
        """Running totals: the engines' prefix cache, preemptions and image encoder cache, then the tokens and
        requests served."""
        counter = self._counter
        self.prefix_cache_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_cache_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.num_preemptions = counter("num_preemptions", "Requests preempted by the scheduler.")
        # An image-text model's (tinyserve/multimodal/): images looked up in its encoder cache, and found there
        self.mm_cache_queries = counter("mm_cache_queries", "Multi-modal cache queries, in terms of number of "
                                        "queried items (images looked up in the encoder cache).")
        self.mm_cache_hits = counter("mm_cache_hits", "Multi-modal cache hits, in terms of number of cached items.")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of requests that reached their first token.")
        self.prompt_tokens_cached = counter("prompt_tokens_cached", "Of those, the prompt tokens found in the "
                                            "prefix cache (not computed).")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        self.request_success = counter("request_success", "Finished requests, by finish reason.", ["finished_reason"])

    def _add_request_histograms(self, token_buckets: list[int]) -> None:
        """Sizes: tokens per engine step, and per finished request its tokens, preemptions and parameters."""
        histogram = self._histogram
        self.iteration_tokens = histogram("iteration_tokens_total", "Tokens per engine step (prompt tokens of "
                                          "requests reaching their first token, plus generated).",
                                          ITERATION_TOKENS_BUCKETS)
        self.request_prompt_tokens = histogram("request_prompt_tokens", "Prompt tokens, per finished request.",
                                               token_buckets)
        self.request_generation_tokens = histogram("request_generation_tokens", "Generated tokens, per finished "
                                                   "request.", token_buckets)
        self.request_prefill_kv_computed = histogram(
            "request_prefill_kv_computed_tokens", "Prompt tokens computed (not found in the prefix cache), per "
            "finished request.", token_buckets)
        self.request_num_preemptions = histogram("request_num_preemptions", "Times a request was preempted, per "
                                                 "finished request.", PREEMPTION_BUCKETS)
        self.request_params_n = histogram("request_params_n", "The n request parameter.", N_BUCKETS)
        self.request_params_max_tokens = histogram("request_params_max_tokens", "The max_tokens request parameter.",
                                                   token_buckets)
        self.request_max_num_generation_tokens = histogram(
            "request_max_num_generation_tokens", "Most tokens generated by one of a request's n samples.",
            token_buckets)

    def _add_latency_histograms(self) -> None:
        """Times: first the front-end clock's (arrival, tokens, finish), then the engine clock's phases."""
        histogram = self._histogram
        self.time_to_first_token = histogram("time_to_first_token_seconds", "Arrival to first token.", TTFT_BUCKETS)
        self.inter_token_latency = histogram("inter_token_latency_seconds", "Time between two output tokens.",
                                             TOKEN_LATENCY_BUCKETS)
        self.time_per_output_token = histogram("request_time_per_output_token_seconds",
                                               "(e2e - TTFT) / (output tokens - 1), per request.",
                                               TOKEN_LATENCY_BUCKETS)
        self.e2e_latency = histogram("e2e_request_latency_seconds", "Arrival to finish.", REQUEST_LATENCY_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds", "Engine: queued to first scheduled (WAITING).",
                                    REQUEST_LATENCY_BUCKETS)
        self.inference_time = histogram("request_inference_time_seconds", "Engine: first scheduled to finish "
                                        "(RUNNING).", REQUEST_LATENCY_BUCKETS)
        self.prefill_time = histogram("request_prefill_time_seconds", "Engine: first scheduled to first token.",
                                      REQUEST_LATENCY_BUCKETS)
        self.decode_time = histogram("request_decode_time_seconds", "Engine: first token to finish.",
                                     REQUEST_LATENCY_BUCKETS)

    def _zero_scheduler_gauges(self) -> None:
        """Every engine's gauge series is visible from the start, at 0, before its first report."""
        for engine in self.engine_indices:
            for metric in (self.num_requests_running, self.num_requests_waiting, self.kv_cache_usage_perc):
                metric.labels(self.model_name, str(engine)).set(0)
            for reason in (WAITING_REASON_CAPACITY, WAITING_REASON_DEFERRED):
                self.num_requests_waiting_by_reason.labels(self.model_name, str(engine), reason).set(0)

    def render(self) -> bytes:
        self.admission_rejections  # noqa: B018 -- registered (at 0) by the first scrape, as vLLM's are at start
        if not self.multiprocess:
            return generate_latest(self.registry)
        registry = CollectorRegistry()
        MultiProcessCollector(registry)  # every API process's files, this one's included
        return generate_latest(registry)

    @functools.cached_property
    def admission_rejections(self) -> dict:
        """vLLM's admission_rejections_total: requests refused because a queue limit was reached, by reason
        (here max_num_queued_reqs alone: --max-waiting-requests; vLLM's max_num_queued_tokens never applies)."""
        counter = Counter(f"{self.prefix}:admission_rejections",
                          "Number of admission attempts rejected by a queue limit, by reason.",
                          ["model_name", "reason"], registry=self.registry)
        return {reason: counter.labels(self.model_name, reason)
                for reason in ("max_num_queued_reqs", "max_num_queued_tokens")}

    def record_admission_rejection(self, reason: str) -> None:
        self.admission_rejections[reason].inc()

    def record_cache_config(self, engine_args, num_kv_blocks: list[int], max_model_len: int | None = None) -> None:
        """vLLM's cache_config_info: a gauge at 1 whose labels are the KV cache's configuration, per engine;
        with max_model_len, vLLM's kv_cache_size_tokens and kv_cache_max_concurrency: how many requests of the
        whole context the pool holds at once (its blocks over a context's blocks), and as many contexts' tokens."""
        info = {"block_size": engine_args.block_size, "enable_prefix_caching": engine_args.enable_prefix_caching,
                "gpu_memory_utilization": engine_args.gpu_memory_utilization, "cache_dtype": engine_args.kv_cache_dtype}
        capacity = ["kv_cache_size_tokens", "kv_cache_max_concurrency"] if max_model_len else []
        self.cache_config_info = Gauge(f"{self.prefix}:cache_config_info",
                                       "Information of the engine's KV cache config.",
                                       [*info, "num_gpu_blocks", *capacity, "engine"], registry=self.registry,
                                       multiprocess_mode="mostrecent")
        for engine, num_blocks in zip(self.engine_indices, num_kv_blocks, strict=True):
            values = {name: str(value) for name, value in info.items()}
            if max_model_len:
                concurrency = num_blocks / -(-max_model_len // engine_args.block_size)
                values |= {"kv_cache_size_tokens": str(int(concurrency * max_model_len)),
                           "kv_cache_max_concurrency": str(concurrency)}
            self.cache_config_info.labels(**values, num_gpu_blocks=str(num_blocks), engine=str(engine)).set(1)
        if getattr(engine_args, "speculative_config", None) is not None:  # visible before the first draft
            self.spec_decode.register()

    def forget_engine_gauges(self, engine_index: int | None = None) -> None:
        """The engines are gone (or engine_index alone, a data-parallel rank that died while others serve):
        their gauges go too, rather than stand at the last values they reported."""
        if engine_index is not None:
            labels = (self.model_name, str(engine_index))
            series = [(metric, labels) for metric in (self.num_requests_running, self.num_requests_waiting,
                                                      self.kv_cache_usage_perc)]
            series += [(self.num_requests_waiting_by_reason, (*labels, reason))
                       for reason in (WAITING_REASON_CAPACITY, WAITING_REASON_DEFERRED)]
            for metric, values in series:
                self._forget(metric, values)
            return
        for metric in (self.num_requests_running, self.num_requests_waiting, self.num_requests_waiting_by_reason,
                       self.kv_cache_usage_perc):
            if self.multiprocess:
                for values in list(metric._metrics):
                    metric.labels(*values).set(0)
            else:
                metric.clear()
        self._awaiting_engine_times.clear()  # their timestamps will never come

    def _forget(self, metric, values) -> None:
        if self.multiprocess:  # another process's file keeps the series: it goes to 0, what a dead engine runs
            metric.labels(*values).set(0)
            return
        with contextlib.suppress(KeyError):  # removed already, at an earlier scrape
            metric.remove(*values)

    def on_request(self, request_id: str, children: list[EngineCoreRequest], params: SamplingParams) -> None:
        self._parents[request_id] = _Parent(params.n, len(children))
        for child in children:
            self._clocks[child.request_id] = _RequestClock(request_id, child.arrival_time, len(child.prompt_token_ids),
                                                           child.sampling_params.max_tokens)

    def on_outputs(self, outputs: EngineCoreOutputs, received_time: float | None = None,
                   stop_string_finishes: dict[str, str] | None = None) -> None:
        """One message of engine outputs; stop_string_finishes: the requests the front end finished on a
        stop string (OutputProcessorOutput), counted with the finish their client got."""
        now = received_time or time.time()
        stop_string_finishes = stop_string_finishes or {}
        engine = str(outputs.engine_index)
        labels = (self.model_name, engine)
        stats = outputs.scheduler_stats
        if stats is not None:
            self.num_requests_running.labels(*labels).set(stats.num_running_reqs)
            self.num_requests_waiting.labels(*labels).set(stats.num_waiting_reqs)
            deferred = stats.num_waiting_deferred_reqs
            self.num_requests_waiting_by_reason.labels(*labels, WAITING_REASON_CAPACITY).set(
                stats.num_waiting_reqs - deferred)
            self.num_requests_waiting_by_reason.labels(*labels, WAITING_REASON_DEFERRED).set(deferred)
            self.kv_cache_usage_perc.labels(*labels).set(stats.kv_cache_usage)
        if stats is not None and self.counts_engine_totals:
            seen = self._counters.setdefault(outputs.engine_index, _EngineCounters())
            # The engine reports running totals; Prometheus counters want increments.
            self.prefix_cache_queries.labels(*labels).inc(stats.prefix_cache_queries - seen.prefix_cache_queries)
            self.prefix_cache_hits.labels(*labels).inc(stats.prefix_cache_hits - seen.prefix_cache_hits)
            self.num_preemptions.labels(*labels).inc(stats.num_preemptions - seen.num_preemptions)
            seen.prefix_cache_queries, seen.prefix_cache_hits = stats.prefix_cache_queries, stats.prefix_cache_hits
            seen.num_preemptions = stats.num_preemptions
            if (mm := stats.mm_cache_stats) is not None:
                self.mm_cache_queries.labels(*labels).inc(mm.queries - seen.mm_cache_queries)
                self.mm_cache_hits.labels(*labels).inc(mm.hits - seen.mm_cache_hits)
                seen.mm_cache_queries, seen.mm_cache_hits = mm.queries, mm.hits
            self.spec_decode.observe(labels, stats.spec_decoding_stats)
        iteration_tokens = 0
        for output in outputs.outputs:
            clock = self._clocks.get(output.request_id)
            if clock is None:
                if output.times is not None and output.request_id in self._awaiting_engine_times:
                    self._observe_engine_times(output.times, self._awaiting_engine_times.pop(output.request_id))
                continue  # a token the engine made before it heard of the stop string, say
            if output.new_token_ids:
                iteration_tokens += len(output.new_token_ids)
                self.generation_tokens.labels(*labels).inc(len(output.new_token_ids))
                if clock.first_token_time is None:
                    clock.first_token_time = now
                    iteration_tokens += clock.num_prompt_tokens
                    self.prompt_tokens.labels(*labels).inc(clock.num_prompt_tokens)
                    self.prompt_tokens_cached.labels(*labels).inc(output.num_cached_tokens)
                    self.time_to_first_token.labels(*labels).observe(now - clock.arrival_time)
                else:
                    self.inter_token_latency.labels(*labels).observe(now - clock.last_token_time)
                clock.last_token_time = now
                clock.num_generated += len(output.new_token_ids)
            finish_reason = stop_string_finishes.get(output.request_id, output.finish_reason)
            if finish_reason is not None:
                self._finish(output, finish_reason, clock, now, labels)
        if outputs.outputs:
            self.iteration_tokens.labels(*labels).observe(iteration_tokens)

    def _finish(self, output: EngineCoreOutput, finish_reason: str, clock: _RequestClock, now: float,
                labels) -> None:
        del self._clocks[output.request_id]
        self.request_success.labels(*labels, finish_reason).inc()
        self.e2e_latency.labels(*labels).observe(now - clock.arrival_time)
        self.request_prompt_tokens.labels(*labels).observe(clock.num_prompt_tokens)
        self.request_generation_tokens.labels(*labels).observe(clock.num_generated)
        # num_cached_tokens: the prefix-cache hit when the request was first scheduled (0 if it never was).
        self.request_prefill_kv_computed.labels(*labels).observe(
            max(clock.num_prompt_tokens - output.num_cached_tokens, 0))
        if clock.max_tokens is not None:
            self.request_params_max_tokens.labels(*labels).observe(clock.max_tokens)
        if clock.first_token_time is not None and clock.num_generated > 1:
            tpot = (now - clock.first_token_time) / (clock.num_generated - 1)
            self.time_per_output_token.labels(*labels).observe(tpot)
        parent = self._parents.get(clock.parent_id)
        if parent is not None:
            parent.num_unfinished -= 1
            parent.max_num_generated = max(parent.max_num_generated, clock.num_generated)
            if parent.num_unfinished == 0:
                del self._parents[clock.parent_id]
                self.request_params_n.labels(*labels).observe(parent.n)
                self.request_max_num_generation_tokens.labels(*labels).observe(parent.max_num_generated)
        if output.times is not None:
            self._observe_engine_times(output.times, labels)
        else:  # finished here, on a stop string: the engine's abort brings its timestamps
            self._awaiting_engine_times[output.request_id] = labels

    def _observe_engine_times(self, times: RequestTimes, labels) -> None:
        self.request_num_preemptions.labels(*labels).observe(len(times.preemption_times))
        if times.first_scheduled_time is None:
            return
        self.queue_time.labels(*labels).observe(times.first_scheduled_time - times.queued_time)
        if times.finished_time is not None:
            self.inference_time.labels(*labels).observe(times.finished_time - times.first_scheduled_time)
        if times.first_token_time is not None:
            self.prefill_time.labels(*labels).observe(times.first_token_time - times.first_scheduled_time)
            if times.finished_time is not None:
                self.decode_time.labels(*labels).observe(times.finished_time - times.first_token_time)
