"""One request's timeline, joined back together from the spans of every process.

    RequestTimeline   one per request span (`chat {model}` / `text_completion {model}`):
                      its request-wide stages (render, enqueue, detokenize, respond), one
                      SequenceTimeline per completion (n of them: ipc.send in the API, then
                      queue → prefill → decode in an engine), the logged inputs and
                      outputs, and the latency metrics (see run.py for their definitions)

It is over 300 lines because it is one object seen whole: the notebooks read a request
through it, and its parts (completions, inputs, per-completion stages) mean nothing alone.
"""

import json
import warnings
from collections import defaultdict
from dataclasses import dataclass

import msgspec

from tinyserve.lifecycle import schema
from tinyserve.trace_reading.otlp_json import Span

# Stages that happen once per engine request, so once per completion when n > 1, each
# span carrying that completion's tinyserve.request_id.
SEQUENCE_STAGES = (schema.IPC_SEND, *schema.ENGINE_STAGES)


def stage_column(span_name: str) -> str:
    """tinyserve.ipc.send → ipc_send_s: the flat column holding a stage's duration in seconds."""
    return span_name.removeprefix("tinyserve.").replace(".", "_") + "_s"


def engine_index_of_service(service: str) -> int | None:
    """tinyserve-engine-3 → 3; None for any other process."""
    suffix = service.rsplit("-", 1)[-1]
    return int(suffix) if suffix.isdigit() and schema.engine_service_name(int(suffix)) == service else None


def process_sort_key(service: str) -> tuple:
    """Orders processes as a reader follows a request: API (or offline) first, then engines by index."""
    index = engine_index_of_service(service)
    return (index is not None, index or 0, service)


def engine_index_of(span: Span) -> int | None:
    if schema.ENGINE_INDEX in span.attributes:
        return int(span.attributes[schema.ENGINE_INDEX])
    return engine_index_of_service(span.service)


def _json_attribute(attributes: dict, key: str):
    value = attributes.get(key)
    return json.loads(value) if isinstance(value, str) else value


# ---- one request ---------------------------------------------------------------------


@dataclass(slots=True)
class Completion:
    index: int
    token_ids: list[int]
    text: str | None
    finish_reason: str | None


@dataclass(slots=True)
class RequestInputs:
    messages: list | None  # the chat messages; None for a text completion
    prompt: str | None  # the prompt text (rendered, for chat)
    prompt_token_ids: list[int] | None
    # SamplingParams' fields as logged (those left at their defaults omitted); LLM.generate takes this dict.
    sampling_params: dict | None
    redacted: bool  # the server was told not to log inputs
    pooling_params: dict | None = None  # a pooling request's (--runner pooling), in place of sampling_params
    # The LoRA adapter it ran under, as logged: {"lora_name", "lora_int_id", "lora_path"}; None: the base model.
    # LLM.generate takes this dict as its lora_request.
    lora_request: dict | None = None
    mm_hashes: list[str] | None = None  # its images' content hashes, in prompt order (<run>/images/<hash>.*)
    mm_placeholders: list[tuple[int, int]] | None = None  # each image's placeholder run (offset, length), aligned


@dataclass(slots=True, eq=False)
class SequenceTimeline:
    """One completion's engine request (a child request when n > 1): sent, queued, prefilled, decoded.

    Its metrics use the engine's clock only (token times, queue/prefill/decode spans).
    """

    request_id: str
    engine_index: int | None
    stages: dict[str, Span]  # of SEQUENCE_STAGES, those present

    @property
    def queue(self) -> Span | None:
        return self.stages.get(schema.QUEUE)

    @property
    def prefill(self) -> Span | None:
        return self.stages.get(schema.PREFILL)

    @property
    def decode(self) -> Span | None:
        return self.stages.get(schema.DECODE)

    @property
    def token_times_ns(self) -> list[int]:
        return list(self.decode.attributes.get(schema.TOKEN_TIMES, [])) if self.decode else []

    @property
    def first_token_ns(self) -> int | None:
        times = self.token_times_ns
        if times:
            return times[0]
        return self.prefill.end_ns if self.prefill else None

    @property
    def num_output_tokens(self) -> int:
        if self.decode and schema.NUM_OUTPUT_TOKENS in self.decode.attributes:
            return int(self.decode.attributes[schema.NUM_OUTPUT_TOKENS])
        return len(self.token_times_ns)

    @property
    def seed(self) -> int | None:
        """The seed this engine request sampled with (a child's own: the parent's seed + its index)."""
        return self.queue.attributes.get(schema.GEN_AI_REQUEST_SEED) if self.queue else None

    @property
    def num_cached_tokens(self) -> int | None:
        return self.prefill.attributes.get(schema.NUM_CACHED_TOKENS) if self.prefill else None

    @property
    def prefill_chunks(self) -> list[tuple[int, int]]:
        """(time ns, prompt tokens computed) for each step that worked on the prompt."""
        if not self.prefill:
            return []
        return [(e.time_ns, e.attributes.get(schema.CHUNK_TOKENS, 0)) for e in self.prefill.events
                if e.name == schema.EVENT_PREFILL_CHUNK]

    @property
    def preemption_times_ns(self) -> list[int]:
        events = (e for span in self.stages.values() for e in span.events)
        return sorted(e.time_ns for e in events if e.name == schema.EVENT_PREEMPTED)

    @property
    def num_preemptions(self) -> int:
        logged = max((span.attributes.get(schema.NUM_PREEMPTIONS, 0) for span in self.stages.values()), default=0)
        return max(logged, len(self.preemption_times_ns))

    @property
    def itls_s(self) -> list[float]:
        times = self.token_times_ns
        return [(later - earlier) / 1e9 for earlier, later in zip(times, times[1:])]

    @property
    def tpot_s(self) -> float | None:
        times = self.token_times_ns
        return (times[-1] - times[0]) / 1e9 / (len(times) - 1) if len(times) > 1 else None

    def duration_s(self, stage: str) -> float | None:
        return self.stages[stage].duration_s if stage in self.stages else None


@dataclass(slots=True, eq=False)
class RequestTimeline:
    request_id: str  # gen_ai.response.id (the id the client saw), else the engine request id
    operation: str  # chat | text_completion
    model: str
    request_span: Span
    http_span: Span | None  # None offline
    stages: dict[str, Span]  # the request-wide stages by span name: render, enqueue, detokenize, respond
    sequences: list[SequenceTimeline]  # one per completion, in the order they were sent to an engine
    inputs: RequestInputs
    completions: list[Completion]
    engine_index: int | None = None

    @property
    def trace_id(self) -> str:
        return self.request_span.trace_id

    @property
    def service(self) -> str:
        return self.request_span.service

    @property
    def arrival_ns(self) -> int:
        return self.request_span.start_ns

    @property
    def first_token_ns(self) -> int | None:
        return min((t for s in self.sequences if (t := s.first_token_ns) is not None), default=None)

    @property
    def ttft_s(self) -> float | None:
        first = self.first_token_ns
        return None if first is None else (first - self.arrival_ns) / 1e9

    @property
    def tpot_s(self) -> float | None:
        intervals = sum(len(s.token_times_ns) - 1 for s in self.sequences if len(s.token_times_ns) > 1)
        spent = sum(s.token_times_ns[-1] - s.token_times_ns[0] for s in self.sequences if len(s.token_times_ns) > 1)
        return spent / 1e9 / intervals if intervals else None

    @property
    def itls_s(self) -> list[float]:
        return [itl for s in self.sequences for itl in s.itls_s]

    @property
    def e2e_s(self) -> float:
        return self.request_span.duration_s

    @property
    def num_prompt_tokens(self) -> int | None:
        attributes = self.request_span.attributes
        for key in (schema.GEN_AI_USAGE_INPUT_TOKENS, schema.NUM_PROMPT_TOKENS):
            if key in attributes:
                return int(attributes[key])
        ids = self.inputs.prompt_token_ids
        return None if ids is None else len(ids)

    @property
    def num_output_tokens(self) -> int:
        if schema.GEN_AI_USAGE_OUTPUT_TOKENS in self.request_span.attributes:
            return int(self.request_span.attributes[schema.GEN_AI_USAGE_OUTPUT_TOKENS])
        return sum(len(c.token_ids) for c in self.completions)

    @property
    def error(self) -> str | None:
        if not self.request_span.is_error:
            return None
        return self.request_span.attributes.get(schema.ERROR_REASON) or self.request_span.status.message or "error"

    @property
    def finish_reasons(self) -> list[str | None]:
        return [c.finish_reason for c in self.completions]

    def stage_spans(self) -> list[Span]:
        """Every stage span of the request, API and engine side, by start time."""
        spans = [*self.stages.values(), *(span for s in self.sequences for span in s.stages.values())]
        return sorted(spans, key=lambda span: span.start_ns)

    def stage_duration_s(self, name: str) -> float | None:
        """One stage's duration; for an engine stage with n > 1, the slowest completion's."""
        if name in self.stages:
            return self.stages[name].duration_s
        durations = [d for s in self.sequences if (d := s.duration_s(name)) is not None]
        return max(durations, default=None)

    def to_record(self) -> dict:
        itls = self.itls_s
        record = {
            "request_id": self.request_id, "operation": self.operation, "model": self.model,
            "trace_id": self.trace_id, "service": self.service, "engine_index": self.engine_index,
            "n": len(self.sequences) or len(self.completions), "arrival_unix_ns": self.arrival_ns,
            "num_prompt_tokens": self.num_prompt_tokens, "num_output_tokens": self.num_output_tokens,
            "num_cached_tokens": self.sequences[0].num_cached_tokens if self.sequences else None,
            "num_preemptions": sum(s.num_preemptions for s in self.sequences),
            "finish_reasons": ",".join(str(reason) for reason in self.finish_reasons),
            "http_status_code": self.http_span.attributes.get("http.response.status_code") if self.http_span else None,
            "error": self.error,
            "ttft_s": self.ttft_s, "tpot_s": self.tpot_s, "mean_itl_s": sum(itls) / len(itls) if itls else None,
            "e2e_s": self.e2e_s,
        }
        record.update({stage_column(name): self.stage_duration_s(name) for name in schema.REQUEST_STAGES})
        return record


def _logged_params(attributes: dict, name: str) -> dict | None:
    params = attributes.get(name)
    if params is None:
        return None
    try:
        return msgspec.json.decode(params, type=dict)
    except (msgspec.DecodeError, ValueError) as error:
        warnings.warn(f"cannot read the logged {name} {params!r}: {error}", stacklevel=4)
        return None


def _inputs(attributes: dict) -> RequestInputs:
    sampling_params = _logged_params(attributes, schema.SAMPLING_PARAMS)
    ids = attributes.get(schema.PROMPT_TOKEN_IDS)
    return RequestInputs(
        messages=_json_attribute(attributes, schema.MESSAGES),
        prompt=attributes.get(schema.PROMPT),
        prompt_token_ids=None if ids is None else list(ids),
        sampling_params=sampling_params,
        redacted=bool(attributes.get(schema.INPUTS_REDACTED, False)),
        pooling_params=_logged_params(attributes, schema.POOLING_PARAMS),
        lora_request=_json_attribute(attributes, schema.LORA_REQUEST),
        mm_hashes=list(attributes[schema.MM_HASHES]) if schema.MM_HASHES in attributes else None,
        mm_placeholders=list(zip(attributes[schema.MM_PLACEHOLDER_OFFSETS], attributes[schema.MM_PLACEHOLDER_LENGTHS]))
        if schema.MM_PLACEHOLDER_OFFSETS in attributes else None,
    )


def _completions(attributes: dict) -> list[Completion]:
    logged = _json_attribute(attributes, schema.COMPLETIONS)
    if logged is not None:
        return [Completion(c["index"], list(c["token_ids"]), c.get("text"), c.get("finish_reason")) for c in logged]
    if schema.OUTPUT_TOKEN_IDS in attributes:  # only the first completion was logged
        reasons = attributes.get(schema.GEN_AI_RESPONSE_FINISH_REASONS) or [None]
        ids = list(attributes[schema.OUTPUT_TOKEN_IDS])
        return [Completion(0, ids, attributes.get(schema.OUTPUT_TEXT), reasons[0])]
    return []


def request_timeline_from_span(request_span: Span, trace: list[Span]) -> RequestTimeline:
    attributes = request_span.attributes
    request_id = str(attributes.get(schema.GEN_AI_RESPONSE_ID) or attributes.get(schema.REQUEST_ID)
                     or request_span.span_id)
    http_span = next((s for s in trace if s.span_id == request_span.parent_span_id), None)
    # A completion is known by its engine spans; its ipc.send joins it when the ids agree.
    engine_stages: dict[str, dict[str, Span]] = defaultdict(dict)
    for span in trace:  # already in start order
        if span.name in schema.ENGINE_STAGES:
            engine_stages[str(span.attributes.get(schema.REQUEST_ID, request_id))].setdefault(span.name, span)
    stages: dict[str, Span] = {}
    for span in trace:
        child_id = str(span.attributes.get(schema.REQUEST_ID, request_id))
        if span.name == schema.IPC_SEND and child_id in engine_stages:
            engine_stages[child_id].setdefault(span.name, span)
        elif span.name in schema.REQUEST_STAGES and span.name not in schema.ENGINE_STAGES:
            stages.setdefault(span.name, span)
    sequences = []
    for child_id, spans in engine_stages.items():
        engine_index = next((i for s in spans.values() if (i := engine_index_of(s)) is not None), None)
        sequences.append(SequenceTimeline(child_id, engine_index, spans))
    # Sent order is completion order: the API sends the children of an n > 1 request by index.
    sequences.sort(key=lambda s: min(span.start_ns for span in s.stages.values()))
    enqueue = stages.get(schema.ENQUEUE)
    engine_index = enqueue.attributes.get(schema.ENGINE_INDEX) if enqueue else None
    if engine_index is None and sequences:
        engine_index = sequences[0].engine_index
    render = stages.get(schema.RENDER)
    logged_inputs = {**attributes, **(render.attributes if render else {})}
    return RequestTimeline(
        request_id=request_id,
        operation=attributes[schema.GEN_AI_OPERATION_NAME],
        model=str(attributes.get(schema.GEN_AI_REQUEST_MODEL, "")),
        request_span=request_span,
        http_span=http_span,
        stages=stages,
        sequences=sequences,
        inputs=_inputs(logged_inputs),
        completions=_completions(attributes),
        engine_index=engine_index,
    )
