"""Write small run folders in tinyserve's trace format, for the trace readers' tests (a helper module).

The writer spells OTLP/JSON by hand, from the format's description and not
from tinyserve's reader: one ExportTraceServiceRequest per line, 64-bit
integers as decimal strings, ids as lowercase hex, a few spans per line and
one file per process. Times are given in milliseconds after T0_NS, so a test
can compute the expected metrics by hand.

    write_run(folder, [SyntheticRequest(...)], [SyntheticStep(...)])        api + engine-N files
    write_run(folder, requests, steps, offline=True)                        offline.jsonl
    write_demo_run(folder)                                                  the run DEMO_* describes
"""

import itertools
import json
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from tinyserve.lifecycle import schema
from tinyserve.sampling_params import SamplingParams

T0_NS = 1_700_000_000_000_000_000
SPAN_KIND_INTERNAL, SPAN_KIND_SERVER = 1, 2
SPANS_PER_LINE = 3


def ns(ms: float) -> int:
    return T0_NS + round(ms * 1_000_000)


@dataclass
class SyntheticSequence:
    """One completion in an engine: queued at queue_start_ms, scheduled at scheduled_ms,
    its tokens at token_times_ms (the first ends the prefill, the last ends the decode)."""

    request_id: str
    engine_index: int
    queue_start_ms: float
    scheduled_ms: float
    token_times_ms: list[float]
    prefill_chunks: list[tuple[float, int]] = field(default_factory=list)  # (ms, tokens)
    preempted_ms: list[float] = field(default_factory=list)  # during the decode
    num_cached_tokens: int = 0
    finish_reason: str = "length"


@dataclass
class SyntheticRequest:
    request_id: str
    operation: str  # chat | text_completion
    arrival_ms: float
    finished_ms: float
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    completions: list[dict]  # {"index", "token_ids", "text", "finish_reason"}
    sequences: list[SyntheticSequence]
    messages: list[dict] | None = None
    prompt: str | None = None
    redacted: bool = False
    model: str = "tiny"


@dataclass
class SyntheticStep:
    engine_index: int
    step_id: int
    start_ms: float
    end_ms: float
    request_ids: list[str]
    tokens_per_request: list[int]
    num_prefill_requests: int
    num_prefill_tokens: int
    kv_blocks_used: int
    kv_blocks_total: int
    num_waiting: int = 0
    preempted_request_ids: list[str] = field(default_factory=list)
    token_budget: int = 16
    prefix_cache_hit_tokens: int = 0


# ---- OTLP/JSON spelling -----------------------------------------------------------------


def otlp_value(value) -> dict:
    if isinstance(value, bool):
        return {"boolValue": value}
    if isinstance(value, int):
        return {"intValue": str(value)}
    if isinstance(value, float):
        return {"doubleValue": value}
    if isinstance(value, str):
        return {"stringValue": value}
    if isinstance(value, list):
        return {"arrayValue": {"values": [otlp_value(v) for v in value]}}
    raise TypeError(f"no OTLP AnyValue for {value!r}")


def otlp_attributes(attributes: dict) -> list[dict]:
    return [{"key": key, "value": otlp_value(value)} for key, value in attributes.items()]


class TraceWriter:
    """Collects OTLP spans per process file, then writes them a few per line."""

    def __init__(self) -> None:
        self.files: dict[str, tuple[str, list[dict]]] = {}  # file name -> (service, spans)
        self._ids = itertools.count(1)

    def new_trace_id(self) -> str:
        return f"{0xabc0000000000000 + next(self._ids):032x}"

    def new_span_id(self) -> str:
        return f"{0x5000000000000000 + next(self._ids):016x}"

    def span(self, file: str, service: str, trace_id: str, parent: str | None, name: str, start_ms: float,
             end_ms: float, attributes: dict | None = None, events: list[dict] | None = None,
             links: list[dict] | None = None, kind: int = SPAN_KIND_INTERNAL, status: dict | None = None) -> str:
        span_id = self.new_span_id()
        span = {"traceId": trace_id, "spanId": span_id, "name": name, "kind": kind,
                "startTimeUnixNano": str(ns(start_ms)), "endTimeUnixNano": str(ns(end_ms)),
                "attributes": otlp_attributes(attributes or {}), "events": events or [], "links": links or [],
                "status": status or {"code": 0}}
        if parent is not None:
            span["parentSpanId"] = parent
        elif name.startswith("POST"):
            span["parentSpanId"] = ""  # writers spell a root either way: empty or absent
        self.files.setdefault(file, (service, []))[1].append(span)
        return span_id

    def write(self, folder: Path) -> None:
        for file, (service, spans) in self.files.items():
            with open(folder / file, "w", encoding="utf-8") as out:
                for start in range(0, len(spans), SPANS_PER_LINE):
                    request = {"resourceSpans": [{
                        "resource": {"attributes": otlp_attributes({"service.name": service})},
                        "scopeSpans": [{"scope": {"name": "tinyserve"}, "spans": spans[start:start + SPANS_PER_LINE]}],
                    }]}
                    out.write(json.dumps(request) + "\n")


def event(name: str, ms: float, attributes: dict | None = None) -> dict:
    return {"timeUnixNano": str(ns(ms)), "name": name, "attributes": otlp_attributes(attributes or {})}


# ---- a run --------------------------------------------------------------------------------


def _write_request(writer: TraceWriter, r: SyntheticRequest, offline: bool) -> dict[str, tuple[str, str]]:
    """The request's spans; returns {engine request id: (trace id, request span id)} for the step links."""
    api_file, api_service = (schema.OFFLINE_TRACE_FILE, schema.SERVICE_OFFLINE) if offline else (schema.API_TRACE_FILE, schema.SERVICE_API)
    trace = writer.new_trace_id()
    path = "/v1/chat/completions" if r.operation == schema.OPERATION_CHAT else "/v1/completions"
    http = None if offline else writer.span(
        api_file, api_service, trace, None, f"POST {path}", r.arrival_ms - 0.5, r.finished_ms + 1.0,
        {"http.request.method": "POST", "url.path": path, "http.response.status_code": 200}, kind=SPAN_KIND_SERVER)
    completions = [{"index": c["index"], "token_ids": c["token_ids"], "text": c["text"], "finish_reason": c["finish_reason"]}
                   for c in r.completions]
    request_attributes = {
        schema.GEN_AI_OPERATION_NAME: r.operation, schema.GEN_AI_PROVIDER_NAME: schema.PROVIDER,
        schema.GEN_AI_REQUEST_MODEL: r.model, schema.GEN_AI_RESPONSE_ID: r.request_id,
        schema.GEN_AI_RESPONSE_FINISH_REASONS: [c["finish_reason"] for c in r.completions],
        schema.GEN_AI_USAGE_INPUT_TOKENS: len(r.prompt_token_ids),
        schema.GEN_AI_USAGE_OUTPUT_TOKENS: sum(len(c["token_ids"]) for c in r.completions),
        schema.COMPLETIONS: json.dumps(completions),
        schema.OUTPUT_TOKEN_IDS: r.completions[0]["token_ids"], schema.OUTPUT_TEXT: r.completions[0]["text"],
    }
    request = writer.span(api_file, api_service, trace, http, schema.request_span_name(r.operation, r.model),
                          r.arrival_ms, r.finished_ms, request_attributes)
    logged = {schema.INPUTS_REDACTED: True} if r.redacted else {
        schema.PROMPT_TOKEN_IDS: r.prompt_token_ids, schema.NUM_PROMPT_TOKENS: len(r.prompt_token_ids),
        schema.SAMPLING_PARAMS: msgspec.json.encode(r.sampling_params).decode(),
        **({schema.MESSAGES: json.dumps(r.messages)} if r.messages is not None else {}),
        **({schema.PROMPT: r.prompt} if r.prompt is not None else {}),
    }
    writer.span(api_file, api_service, trace, request, schema.RENDER, r.arrival_ms, r.arrival_ms + 1, logged)
    writer.span(api_file, api_service, trace, request, schema.ENQUEUE, r.arrival_ms + 1, r.arrival_ms + 1.5,
                {schema.REQUEST_ID: r.request_id, schema.ENGINE_INDEX: r.sequences[0].engine_index})
    served = {}
    for number, s in enumerate(r.sequences):
        file, service = (api_file, api_service) if offline else (schema.engine_trace_file(s.engine_index),
                                                                 schema.engine_service_name(s.engine_index))
        ids = {schema.REQUEST_ID: s.request_id, schema.ENGINE_INDEX: s.engine_index}
        if len(r.sequences) > 1:
            ids[schema.PARENT_REQUEST_ID] = r.request_id
        if not offline:  # each completion is its own engine request, sent on its own
            sent = r.arrival_ms + 1.5 + 0.1 * number
            writer.span(api_file, api_service, trace, request, schema.IPC_SEND, sent, sent + 0.1,
                        {**ids, schema.IPC_BYTES: 200, schema.IPC_SOCKET: "ipc:///tmp/tinyserve-input"})
        first, last = s.token_times_ms[0], s.token_times_ms[-1]
        writer.span(file, service, trace, request, schema.QUEUE, s.queue_start_ms, s.scheduled_ms,
                    {**ids, schema.QUEUE_DEPTH_AT_ARRIVAL: 0})
        writer.span(file, service, trace, request, schema.PREFILL, s.scheduled_ms, first,
                    {**ids, schema.NUM_CACHED_TOKENS: s.num_cached_tokens},
                    events=[event(schema.EVENT_PREFILL_CHUNK, ms, {schema.CHUNK_TOKENS: tokens}) for ms, tokens in s.prefill_chunks])
        writer.span(file, service, trace, request, schema.DECODE, first, last,
                    {**ids, schema.NUM_OUTPUT_TOKENS: len(s.token_times_ms),
                     schema.TOKEN_TIMES: [ns(ms) for ms in s.token_times_ms],
                     schema.NUM_PREEMPTIONS: len(s.preempted_ms), schema.FINISH_REASON: s.finish_reason},
                    events=[event(schema.EVENT_PREEMPTED, ms) for ms in s.preempted_ms])
        served[s.request_id] = (trace, request)
    first_token = min(s.token_times_ms[0] for s in r.sequences)
    writer.span(api_file, api_service, trace, request, schema.DETOKENIZE, first_token + 0.1, r.finished_ms - 0.1,
                {schema.DETOKENIZE_CALLS: sum(len(c["token_ids"]) for c in r.completions), schema.DETOKENIZE_TIME: 0.0001})
    if not offline:
        writer.span(api_file, api_service, trace, http, schema.RESPOND, first_token + 0.2, r.finished_ms + 0.5,
                    {schema.STREAMED: False, schema.RESPOND_CHUNKS: 1, schema.RESPOND_BYTES: 512})
    return served


def _write_step(writer: TraceWriter, step: SyntheticStep, served: dict[str, tuple[str, str]], offline: bool) -> None:
    file, service = (schema.OFFLINE_TRACE_FILE, schema.SERVICE_OFFLINE) if offline else (
        schema.engine_trace_file(step.engine_index), schema.engine_service_name(step.engine_index))
    decode_tokens = sum(step.tokens_per_request) - step.num_prefill_tokens
    attributes = {
        schema.STEP_ID: step.step_id, schema.ENGINE_INDEX: step.engine_index,
        schema.STEP_REQUEST_IDS: step.request_ids, schema.STEP_TOKENS_PER_REQUEST: step.tokens_per_request,
        schema.STEP_NUM_PREFILL_REQUESTS: step.num_prefill_requests,
        schema.STEP_NUM_DECODE_REQUESTS: len(step.request_ids) - step.num_prefill_requests,
        schema.STEP_NUM_PREFILL_TOKENS: step.num_prefill_tokens, schema.STEP_NUM_DECODE_TOKENS: decode_tokens,
        schema.STEP_NUM_SCHEDULED_TOKENS: sum(step.tokens_per_request), schema.STEP_TOKEN_BUDGET: step.token_budget,
        schema.STEP_PREEMPTED_REQUEST_IDS: step.preempted_request_ids, schema.STEP_FINISHED_REQUEST_IDS: [],
        schema.KV_BLOCKS_USED: step.kv_blocks_used, schema.KV_BLOCKS_FREE: step.kv_blocks_total - step.kv_blocks_used,
        schema.KV_BLOCKS_TOTAL: step.kv_blocks_total, schema.KV_USAGE: step.kv_blocks_used / step.kv_blocks_total,
        schema.PREFIX_CACHE_HIT_TOKENS: step.prefix_cache_hit_tokens,
        schema.NUM_WAITING: step.num_waiting, schema.NUM_RUNNING: len(step.request_ids),
    }
    links = [{"traceId": served[r][0], "spanId": served[r][1], "attributes": []} for r in step.request_ids if r in served]
    trace = writer.new_trace_id()
    step_span = writer.span(file, service, trace, None, schema.STEP, step.start_ms, step.end_ms, attributes, links=links)
    # schedule 10%, execute 80%, update 10% of the step
    length = step.end_ms - step.start_ms
    bounds = [step.start_ms, step.start_ms + 0.1 * length, step.start_ms + 0.9 * length, step.end_ms]
    for name, start, end in zip((schema.SCHEDULE, schema.EXECUTE, schema.UPDATE), bounds, bounds[1:]):
        writer.span(file, service, trace, step_span, name, start, end)


def write_run(folder: str | Path, requests: list[SyntheticRequest], steps: list[SyntheticStep], *, offline: bool = False,
              model: str = "/models/tiny", engine_args: dict | None = None) -> Path:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    writer = TraceWriter()
    served = {}
    for request in requests:
        served.update(_write_request(writer, request, offline))
    for step in steps:
        _write_step(writer, step, served, offline)
    writer.write(folder)
    engines = {s.engine_index for r in requests for s in r.sequences} | {s.engine_index for s in steps}
    manifest = {"tinyserve_version": "0.1.0", "model": model, "served_model_name": "tiny",
                "engine_args": engine_args if engine_args is not None else {"model": model, "block_size": 16},
                "start_time_unix_nano": T0_NS, "data_parallel_size": len(engines)}
    (folder / schema.MANIFEST_FILE).write_text(json.dumps(manifest))
    return folder


# ---- the demo run: two engines, three requests, five steps ------------------------------------
#
#   chatcmpl-a   chat, n=1, engine 0   arrives 0 ms, tokens at 15 25 35 45, done 60
#                                      queue 3→5, prefill 5→15 (chunks 6 + 4 tokens)
#   cmpl-b       text, n=2, engine 1   arrives 10 ms, done 70; seeded sampling
#                  0_cmpl-b            queue 13→14, tokens at 20 26 32, preempted at 24
#                  1_cmpl-b            queue 13.5→16, tokens at 22 30 40
#   chatcmpl-c   chat, n=1, engine 0   arrives 30 ms, tokens at 40 44, done 50; inputs redacted

DEMO_REQUESTS = [
    SyntheticRequest(
        "chatcmpl-a", schema.OPERATION_CHAT, 0.0, 60.0, prompt_token_ids=[1, 2, 3, 4, 5, 6, 7, 8, 9, 10],
        sampling_params=SamplingParams(temperature=0.0, max_tokens=4),
        completions=[{"index": 0, "token_ids": [11, 12, 13, 14], "text": "abcd", "finish_reason": "length"}],
        sequences=[SyntheticSequence("chatcmpl-a", 0, 3.0, 5.0, [15.0, 25.0, 35.0, 45.0], prefill_chunks=[(10.0, 6), (15.0, 4)])],
        messages=[{"role": "user", "content": "hi"}], prompt="<user>hi</user>"),
    SyntheticRequest(
        "cmpl-b", schema.OPERATION_TEXT_COMPLETION, 10.0, 70.0, prompt_token_ids=[5, 6, 7, 8, 9],
        sampling_params=SamplingParams(n=2, temperature=0.8, seed=7, max_tokens=3),
        completions=[{"index": 0, "token_ids": [21, 22, 23], "text": "xyz", "finish_reason": "length"},
                     {"index": 1, "token_ids": [31, 32, 33], "text": "uvw", "finish_reason": "length"}],
        sequences=[SyntheticSequence("0_cmpl-b", 1, 13.0, 14.0, [20.0, 26.0, 32.0], preempted_ms=[24.0]),
                   SyntheticSequence("1_cmpl-b", 1, 13.5, 16.0, [22.0, 30.0, 40.0])],
        prompt="Once upon"),
    SyntheticRequest(
        "chatcmpl-c", schema.OPERATION_CHAT, 30.0, 50.0, prompt_token_ids=[3, 4, 5, 6, 7],
        sampling_params=SamplingParams(temperature=1.0, max_tokens=2),
        completions=[{"index": 0, "token_ids": [41, 42], "text": "ok", "finish_reason": "length"}],
        sequences=[SyntheticSequence("chatcmpl-c", 0, 33.0, 36.0, [40.0, 44.0])], redacted=True),
]

DEMO_STEPS = [
    SyntheticStep(0, 0, 5.0, 10.0, ["chatcmpl-a"], [6], 1, 6, kv_blocks_used=1, kv_blocks_total=8),
    SyntheticStep(0, 1, 10.0, 15.0, ["chatcmpl-a"], [4], 1, 4, kv_blocks_used=1, kv_blocks_total=8),
    SyntheticStep(0, 2, 36.0, 40.0, ["chatcmpl-a", "chatcmpl-c"], [1, 5], 1, 5, kv_blocks_used=3, kv_blocks_total=8),
    SyntheticStep(1, 0, 14.0, 20.0, ["0_cmpl-b"], [5], 1, 5, kv_blocks_used=1, kv_blocks_total=4),
    SyntheticStep(1, 1, 20.0, 22.0, ["0_cmpl-b", "1_cmpl-b"], [1, 5], 1, 5, kv_blocks_used=4, kv_blocks_total=4,
                  num_waiting=1, preempted_request_ids=["0_cmpl-b"]),
]


def write_demo_run(folder: str | Path) -> Path:
    return write_run(folder, DEMO_REQUESTS, DEMO_STEPS)
