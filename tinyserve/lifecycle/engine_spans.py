"""Engine-side spans, built from timestamps the engine already recorded.

The busy loop never touches OpenTelemetry. It tells the builder of each new
request (`on_request`), and after each step hands it what the step decided, its
clock, the stats and the outputs (`record_step`); the builder keeps the little it
needs (each request's trace context, the prefix-cache counter) and a background
thread turns the records into spans with the recorded start and end times:

- per finished request, in the request's own trace (parent = the API's request
  span, carried in EngineCoreRequest.trace_context):
      tinyserve.queue    queued → first scheduled
      tinyserve.prefill  first scheduled → first token (one event per prompt chunk)
      tinyserve.decode   first token → finished (token timestamps, preemptions)
- per step: tinyserve.step with schedule/execute/update children, the batch and KV
  attributes, and a link to each request it served; the steps of each TIMELINE_WINDOW_S
  are the children of one tinyserve.engine_timeline span, a trace of its own (so an OTLP
  viewer lists requests and a few timelines, not a trace per step). A request's prefill
  and decode spans link back to the timelines that hold its steps.

In the offline `LLM` (inline=True) there is no thread: the records wait in a list
and are built, and exported, in the caller's thread every INLINE_BATCH steps and
when generate() finishes. There the CPU is already fully used by PyTorch's own
threads, and a background thread costs more than its CPU time: every parallel
operator it interrupts waits for the core it took.
"""

import queue
import threading

from opentelemetry.sdk.trace import Event
from opentelemetry.trace import Link, Status, StatusCode

from tinyserve.lifecycle import schema
from tinyserve.lifecycle.ended_spans import EndedSpans, span_context_of
from tinyserve.lifecycle.engine_records import (
    FinishedRequest,
    StepSpanInput,
    StepTimes,
    TracedRequest,
    block_changes,
)
from tinyserve.lifecycle.timeline_windows import TimelineWindows
from tinyserve.lifecycle.tracing import extract_context, flush_tracing, get_tracer

INLINE_BATCH = 256  # steps whose spans an inline builder holds before building them


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


class EngineSpanBuilder:
    def __init__(self, engine_index: int, *, inline: bool = False, structured_outputs_backend: str = "") -> None:
        self.engine_index = engine_index
        self.structured_outputs_backend = structured_outputs_backend
        self.tracer = get_tracer()
        self.spans = EndedSpans(self.tracer)  # every span here has ended before it is built
        self.inline = inline
        self._pending: list[tuple] = []  # inline: records not built yet
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        # The link to each running request's span, made once from its trace context:
        # parsing a traceparent for every request at every step would cost more than
        # the rest of the step span. Dropped when the request finishes.
        self._links: dict[str, Link | None] = {}
        self._traced: dict[str, TracedRequest] = {}  # the engine thread's own: requests not finished yet
        self._prefix_cache_hits = 0  # the engine's cumulative count at the last step
        self.timelines = TimelineWindows(self.tracer, engine_index)  # the steps' parents, per minute
        self._released: list[str] = []  # finished since the last step span, not yet in one
        self._thread = None
        if not inline:
            self._thread = threading.Thread(target=self._run, name=f"tinyserve-spans-{engine_index}", daemon=True)
            self._thread.start()

    # ---- called from the engine loop: cheap -------------------------------------

    def on_request(self, request_id: str, trace_context: dict[str, str], num_prompt_tokens: int,
                   queue_depth: int, structured_output_kind: str | None = None, seed: int | None = None,
                   attributes: dict | None = None) -> None:
        """A request was queued: remember what its spans will need (seed: its own, a child's seed + index;
        attributes: for its queue span, from layers beside the engine, such as its LoRA adapter)."""
        self._traced[request_id] = TracedRequest(trace_context, num_prompt_tokens, queue_depth, structured_output_kind,
                                                 seed, attributes or {})

    def record_step(self, scheduler_output, times: StepTimes, stats, outputs: list,
                    attributes: dict | None = None, finished_attributes: dict | None = None,
                    prefill_attributes: dict | None = None) -> None:
        """After a step: its SchedulerOutput, clock, SchedulerStats and EngineCoreOutputs' outputs (attributes:
        more for its span, from layers beside the engine; finished_attributes: request id -> more for the
        decode span of a request that finished; prefill_attributes: the same for its prefill span)."""
        hits, self._prefix_cache_hits = stats.prefix_cache_hits - self._prefix_cache_hits, stats.prefix_cache_hits
        finished = self._finished(outputs, finished_attributes, prefill_attributes)
        # Released blocks are told with the step that tells the worker. An empty step has a span only
        # when it does that: the engine ran it for no other reason (a client left, and nothing else runs),
        # and without it the release would be in no span at all while the engine stays idle.
        self._released += scheduler_output.finished_request_ids
        if scheduler_output.is_empty and not self._released:
            if finished:
                self._submit(None, {}, finished)
            return
        record = StepSpanInput(scheduler_output, times, stats, hits,
                                [output.request_id for output in outputs if output.finished], self._released,
                                attributes or {})
        self._released = []
        served = {s.request_id: self._traced[s.request_id].trace_context
                  for s in scheduler_output.scheduled if s.request_id in self._traced}
        self._submit(record, served, finished)

    def record_finished(self, outputs: list, finished_attributes: dict | None = None,
                        prefill_attributes: dict | None = None) -> None:
        """Requests that finished outside a step (aborted): their spans."""
        finished = self._finished(outputs, finished_attributes, prefill_attributes)
        if finished:
            self._submit(None, {}, finished)

    def _finished(self, outputs: list, finished_attributes: dict | None = None,
                  prefill_attributes: dict | None = None) -> list[FinishedRequest]:
        finished = []
        for output in outputs:
            traced = self._traced.pop(output.request_id, None) if output.finished else None
            if traced is not None:
                finished.append(FinishedRequest(
                    output.request_id, traced.trace_context, output.times, output.finish_reason,
                    output.num_cached_tokens, traced.num_prompt_tokens, len(output.times.token_times),
                    traced.queue_depth_at_arrival, traced.structured_output_kind, traced.seed, traced.attributes,
                    (finished_attributes or {}).get(output.request_id, {}),
                    (prefill_attributes or {}).get(output.request_id, {}),
                ))
        return finished

    def _submit(self, step, served_contexts: dict[str, dict[str, str]], finished: list[FinishedRequest]) -> None:
        if not self.inline:
            self._queue.put((step, served_contexts, finished))
            return
        self._pending.append((step, served_contexts, finished))
        if len(self._pending) >= INLINE_BATCH:
            self._build_pending()

    def flush(self, timeout: float = 30.0) -> None:
        """Return once every span submitted so far has been built."""
        if self.inline:
            self._build_pending()
            return
        done = threading.Event()
        self._queue.put(done)
        done.wait(timeout)

    def close(self) -> None:
        """Build every span still queued, then stop the thread."""
        if self.inline:
            self._build_pending()
            return
        self._queue.put(None)
        self._thread.join(timeout=30)
        self.timelines.end()

    def _build_pending(self) -> None:
        pending, self._pending = self._pending, []
        for item in pending:
            self._build(*item)
        self.timelines.end()  # generate() ended, or a batch: its timeline goes out with its steps
        flush_tracing()  # export now, in this thread, not on the exporter's thread during a step

    # ---- the background thread -----------------------------------------------------

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            if isinstance(item, threading.Event):
                self.timelines.end()  # a flush: everything so far, the open timeline too, is built
                item.set()
                continue
            self._build(*item)

    def _build(self, step, served_contexts: dict[str, dict[str, str]], finished: list[FinishedRequest]) -> None:
        if step is not None:
            self._step_spans(step, served_contexts)
        for request in finished:
            self._request_spans(request)

    def _request_spans(self, request: FinishedRequest) -> None:
        self._links.pop(request.request_id, None)
        timelines = self.timelines.links_of(request.request_id)
        parent = span_context_of(extract_context(request.trace_context))
        times = request.times
        common = {schema.REQUEST_ID: request.request_id, schema.ENGINE_INDEX: self.engine_index}
        end = times.finished_time
        scheduled = times.first_scheduled_time or end
        self.spans.record(schema.QUEUE, parent, _ns(times.queued_time), _ns(scheduled), {
            **common, schema.QUEUE_DEPTH_AT_ARRIVAL: request.queue_depth_at_arrival,
            **({schema.GEN_AI_REQUEST_SEED: request.seed} if request.seed is not None else {}), **request.attributes})
        if request.structured_output_kind is not None and times.structured_output_start is not None:
            self.spans.record(schema.STRUCTURED_OUTPUT, parent, _ns(times.structured_output_start),
                              _ns(times.structured_output_end or end), {
                                  **common, schema.STRUCTURED_OUTPUT_KIND: request.structured_output_kind,
                                  schema.STRUCTURED_OUTPUT_CACHE_HIT: times.structured_output_cache_hit,
                                  schema.STRUCTURED_OUTPUT_BACKEND: self.structured_outputs_backend,
                                  schema.STRUCTURED_OUTPUT_GRAMMAR_START: times.structured_output_grammar_start})
        if times.first_scheduled_time is None:  # aborted while waiting: nothing else happened
            return
        first_token = times.first_token_time or end
        events = [Event(schema.EVENT_PREFILL_CHUNK, {schema.CHUNK_TOKENS: num_tokens}, _ns(chunk_time))
                  for chunk_time, num_tokens in times.prefill_chunks if chunk_time <= first_token]
        events += [Event(schema.EVENT_PREEMPTED, None, _ns(preempted))
                   for preempted in times.preemption_times if preempted <= first_token]
        self.spans.record(schema.PREFILL, parent, _ns(scheduled), _ns(first_token), {
            **common, schema.NUM_CACHED_TOKENS: request.num_cached_tokens, schema.NUM_PROMPT_TOKENS: request.num_prompt_tokens,
            **request.prefill_attributes,
        }, timelines, events, self._status(request.finish_reason if times.first_token_time is None else None))
        if times.first_token_time is None:
            return
        self.spans.record(schema.DECODE, parent, _ns(first_token), _ns(end), {
            **common,
            schema.NUM_OUTPUT_TOKENS: request.num_output_tokens,
            schema.TOKEN_TIMES: [_ns(t) for t in times.token_times],
            schema.NUM_PREEMPTIONS: len(times.preemption_times),
            schema.FINISH_REASON: request.finish_reason,
            **request.decode_attributes,
        }, timelines, [Event(schema.EVENT_PREEMPTED, None, _ns(preempted))
                       for preempted in times.preemption_times if preempted > first_token],
            self._status(request.finish_reason))

    @staticmethod
    def _link_to(trace_context: dict[str, str]) -> Link | None:
        context = extract_context(trace_context)
        if context is None:
            return None
        # No attributes on the link: the step's request ids list the same requests in the same order.
        return Link(span_context_of(context))

    @staticmethod
    def _status(finish_reason: str | None) -> Status:
        return Status(StatusCode.ERROR, "aborted") if finish_reason == "abort" else Status(StatusCode.UNSET)

    def _step_spans(self, record: StepSpanInput, served_contexts: dict[str, dict[str, str]]) -> None:
        out = record.scheduler_output
        stats = record.stats
        links = []
        for scheduled in out.scheduled:
            request_id = scheduled.request_id
            if request_id not in self._links:
                self._links[request_id] = self._link_to(served_contexts.get(request_id, {}))
            if self._links[request_id] is not None:
                links.append(self._links[request_id])
        attributes = {
            schema.STEP_ID: out.step_id,
            schema.ENGINE_INDEX: self.engine_index,
            schema.STEP_REQUEST_IDS: [s.request_id for s in out.scheduled],
            schema.STEP_TOKENS_PER_REQUEST: [s.num_new_tokens for s in out.scheduled],
            schema.STEP_NUM_PREFILL_REQUESTS: out.num_prefill_requests,
            schema.STEP_NUM_DECODE_REQUESTS: out.num_decode_requests,
            schema.STEP_NUM_PREFILL_TOKENS: out.num_prefill_tokens,
            schema.STEP_NUM_DECODE_TOKENS: out.num_decode_tokens,
            schema.STEP_NUM_SCHEDULED_TOKENS: out.total_num_scheduled_tokens,
            schema.STEP_TOKEN_BUDGET: out.token_budget,
            schema.STEP_PREEMPTED_REQUEST_IDS: out.preempted_request_ids,
            schema.STEP_FINISHED_REQUEST_IDS: record.finished_request_ids,
            schema.STEP_NUM_CONSTRAINED_REQUESTS: len(out.structured_output_request_ids),
            schema.STEP_GRAMMAR_BITMASK_TIME: out.grammar_bitmask_time,
            schema.STEP_RELEASED_REQUEST_IDS: record.released_request_ids,
            **block_changes(out.scheduled),
            schema.KV_BLOCKS_USED: stats.num_kv_blocks_used,
            schema.KV_BLOCKS_FREE: stats.num_kv_blocks_total - stats.num_kv_blocks_used,
            schema.KV_BLOCKS_TOTAL: stats.num_kv_blocks_total,
            schema.KV_USAGE: stats.kv_cache_usage,
            schema.PREFIX_CACHE_HIT_TOKENS: record.prefix_cache_hit_tokens,
            schema.NUM_WAITING: stats.num_waiting_reqs,
            schema.NUM_RUNNING: stats.num_running_reqs,
            **record.attributes,
        }
        times = record.times
        timeline = self.timelines.context_for(times.start, times.end,
                                              [s.request_id for s in out.scheduled if s.request_id in served_contexts])
        step = self.spans.record(schema.STEP, timeline, _ns(times.start), _ns(times.end), attributes, links)
        phases = [(schema.SCHEDULE, times.start, times.scheduled, None),
                  (schema.EXECUTE, times.scheduled, times.executed, None if times.cpu_threads is None else {
                      schema.EXECUTE_CPU_THREADS: times.cpu_threads, schema.EXECUTE_CPU_TIME: times.execute_cpu_s}),
                  (schema.UPDATE, times.executed, times.end, None)]
        if times.ranks:  # one execute per rank, each with its own clock
            phases[1:2] = [(schema.EXECUTE, r.start, r.end, r.attributes(times.ranks)) for r in times.ranks]
        execute = None
        for name, start, end, phase_attributes in phases:
            phase = self.spans.record(name, step, _ns(start), _ns(end), phase_attributes)
            execute = execute or (phase if name == schema.EXECUTE else None)  # the first rank's, where several
        for name, start, end, stage_attributes in times.stages:  # a layer's own stages inside execute
            self.spans.record(name, execute, _ns(start), _ns(end), stage_attributes)

