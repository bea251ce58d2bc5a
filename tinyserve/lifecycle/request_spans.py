"""The spans of one request on the API side (or offline): the request span and its stages.

    spans = start_request_spans("chat", model, request_id)   # child of the HTTP span
    with spans.stage(schema.RENDER) as render:                # template + tokenize
        ...
        spans.log_inputs(render, prompt=..., prompt_token_ids=..., sampling_params=...)
    carrier = spans.carrier()                                 # into EngineCoreRequest.trace_context
    with spans.enqueueing(request_id) as enqueued:            # the front end registers and sends it
        with spans.sending(child_id) as sent:                 # one ipc.send per engine request
            sent.engine_index, sent.num_bytes = ...
        enqueued.engine_index = ...
    with spans.detokenizing:                                  # each detokenizer update, clocked
        ...
    spans.finish(completions)                                  # or spans.fail(error)

With tracing off, start_request_spans returns NO_SPANS, whose methods do nothing (and
whose `detokenizing` reads no clock). The front end does not take these as a parameter: it
finds them by request id (frontend/request_observers.py) and reports what it did; the span
names and attributes are written here alone.
"""

import json
import time
from contextlib import contextmanager, nullcontext

import msgspec
from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode

from tinyserve.lifecycle import schema
from tinyserve.lifecycle.tracing import get_tracer, inject_context, logged_json, tracing_enabled


class RequestSpans:
    def __init__(self, operation: str, model: str, request_id: str, *, redact_inputs: bool = False) -> None:
        self.tracer = get_tracer()
        self.redact_inputs = redact_inputs
        self.span = self.tracer.start_span(
            schema.request_span_name(operation, model),
            attributes={
                schema.GEN_AI_OPERATION_NAME: operation,
                schema.GEN_AI_PROVIDER_NAME: schema.PROVIDER,
                schema.GEN_AI_REQUEST_MODEL: model,
                schema.GEN_AI_RESPONSE_ID: request_id,
                schema.GEN_AI_RESPONSE_MODEL: model,
                schema.REQUEST_ID: request_id,
                schema.OPENINFERENCE_SPAN_KIND: schema.OPENINFERENCE_LLM,
                schema.LLM_MODEL_NAME: model,
            },
        )
        self._num_prompt_tokens = 0
        self.context = trace.set_span_in_context(self.span)
        self.detokenizing = DetokenizeClock()  # the output processor's `with`: the detokenize span's input
        self._ended = False

    @contextmanager
    def stage(self, name: str, attributes: dict | None = None):
        with self.tracer.start_as_current_span(name, context=self.context, attributes=attributes) as span:
            yield span

    def carrier(self) -> dict[str, str]:
        return inject_context(self.context)

    @contextmanager
    def enqueueing(self, request_id: str):
        """The enqueue span: the request registered with the output processor and sent. The front end sets
        the yielded record's engine_index (the engine of its last send); offline, nothing is sent."""
        enqueued = Sent()
        with self.stage(schema.ENQUEUE, {schema.REQUEST_ID: request_id}) as span:
            yield enqueued
            if enqueued.engine_index is not None:
                span.set_attribute(schema.ENGINE_INDEX, enqueued.engine_index)

    @contextmanager
    def sending(self, request_id: str):
        """The ipc.send span of one engine request (request_id: its own, a child's for n > 1). The front end
        sets the yielded record's engine_index and num_bytes (the message's size; None: an engine in this
        process, where nothing crosses a socket, and the span has no size)."""
        sent = Sent()
        with self.stage(schema.IPC_SEND, {schema.REQUEST_ID: request_id}) as span:
            yield sent
            span.set_attribute(schema.ENGINE_INDEX, sent.engine_index)
            if sent.num_bytes is not None:
                span.set_attribute(schema.IPC_BYTES, sent.num_bytes)

    def log_inputs(self, span, *, prompt: str | None, prompt_token_ids: list[int], sampling_params,
                   messages: list[dict] | None = None, mm_features: list | None = None) -> None:
        """Everything replay needs, on the render span (images by hash: multimodal/processor.py's keep_images);
        the request span gets the GenAI request attributes."""
        params = sampling_params
        pooling = _is_pooling(params)  # a pooling request: nothing sampled
        self.span.set_attributes({
            schema.GEN_AI_USAGE_INPUT_TOKENS: len(prompt_token_ids),
            schema.LLM_TOKEN_COUNT_PROMPT: len(prompt_token_ids),
            **({} if pooling else {
                schema.GEN_AI_REQUEST_MAX_TOKENS: params.max_tokens or 0,
                schema.GEN_AI_REQUEST_TEMPERATURE: params.temperature,
                schema.GEN_AI_REQUEST_TOP_P: params.top_p,
                **({schema.GEN_AI_REQUEST_SEED: params.seed} if params.seed is not None else {}),
            }),
        })
        self._num_prompt_tokens = len(prompt_token_ids)
        if not self.redact_inputs:  # what a viewer shows as the request's input: the messages, or the prompt
            self.span.set_attributes(
                {schema.INPUT_VALUE: logged_json(messages), schema.INPUT_MIME_TYPE: "application/json"}
                if messages is not None else {schema.INPUT_VALUE: prompt or "", schema.INPUT_MIME_TYPE: "text/plain"})
        attributes = {
            schema.NUM_PROMPT_TOKENS: len(prompt_token_ids),
            **image_attributes(mm_features or ()),
            # Stop strings are user text too: a redacted trace keeps only how many there were.
        }
        if pooling:
            attributes[schema.POOLING_PARAMS] = msgspec.json.encode(params).decode()
        else:
            attributes[schema.SAMPLING_PARAMS] = msgspec.json.encode(
                params.clone(stop=["<redacted>"] * len(params.stop)) if self.redact_inputs and params.stop else params
            ).decode()
        if self.redact_inputs:
            attributes[schema.INPUTS_REDACTED] = True
        else:
            attributes[schema.PROMPT_TOKEN_IDS] = prompt_token_ids
            if prompt is not None:
                attributes[schema.PROMPT] = prompt
            if messages is not None:
                attributes[schema.MESSAGES] = logged_json(messages)
        span.set_attributes(attributes)

    def log_lora(self, lora_request, span=None) -> None:
        """The request's LoRA adapter (None: the base model): its name, and the whole LoRARequest as JSON
        with the logged inputs (replay runs under it), on the request span and on `span` (the render span)."""
        if lora_request is None:
            return
        attributes = {schema.LORA_NAME: lora_request.lora_name, schema.LORA_REQUEST: msgspec.json.encode({
            "lora_name": lora_request.lora_name, "lora_int_id": lora_request.lora_int_id,
            "lora_path": lora_request.lora_path}).decode()}
        for target in (self.span, span):
            if target is not None:
                target.set_attributes(attributes)

    def _detokenize_span(self, completions) -> None:
        """The detokenize span, built at the end from the clock of every detokenizer update."""
        clock = self.detokenizing
        if clock.first is None:
            return
        span = self.tracer.start_span(schema.DETOKENIZE, context=self.context, start_time=int(clock.first * 1e9),
                                      attributes={schema.DETOKENIZE_CALLS: clock.calls,
                                                  schema.DETOKENIZE_TIME: clock.seconds})
        # A stop string is the one text a stop reason can be (a stop token's is its id).
        stop_strings = [c.stop_reason for c in completions if isinstance(c.stop_reason, str)]
        if stop_strings and not self.redact_inputs:
            span.set_attribute(schema.STOP_STRING, stop_strings[-1])
        span.end(end_time=int(clock.last * 1e9))

    def reasoning_read(self, parser: str, num_tokens: list[int], ended_at: list[int]) -> None:
        """The reasoning parser read the answer (tinyserve/reasoning/): a tinyserve.reasoning span, as long as
        none (the reading follows the output), in the request's trace; per choice, the tokens read as reasoning
        and the output token count its reasoning ended at (-1: never)."""
        self.tracer.start_span(schema.REASONING, context=self.context, attributes={
            schema.REASONING_PARSER: parser, schema.REASONING_NUM_TOKENS: num_tokens,
            schema.REASONING_ENDED_AT: ended_at}).end()

    def pooled(self, dimensions: int) -> None:
        """A pooling request got its vector, of this many dimensions (the span keeps its size, not its values)."""
        self.span.set_attribute(schema.POOLING_DIMENSIONS, dimensions)

    def finish(self, completions, error: BaseException | None = None) -> None:
        """End the request span with its outputs (CompletionOutputs, cumulative); `error`: why the server
        ended it (its engine died, its grammar was not compiled in time), else an abort is the client's."""
        if self._ended:
            return
        completions = sorted(completions, key=lambda c: c.index)
        self._detokenize_span(completions)
        num_output_tokens = sum(len(c.token_ids) for c in completions)
        attributes = {
            schema.GEN_AI_RESPONSE_FINISH_REASONS: [c.finish_reason or "abort" for c in completions],
            schema.GEN_AI_USAGE_OUTPUT_TOKENS: num_output_tokens,
            schema.LLM_TOKEN_COUNT_COMPLETION: num_output_tokens,
            schema.LLM_TOKEN_COUNT_TOTAL: self._num_prompt_tokens + num_output_tokens,
        }
        if not self.redact_inputs and completions:
            attributes[schema.OUTPUT_TOKEN_IDS] = completions[0].token_ids
            attributes[schema.OUTPUT_TEXT] = completions[0].text
            attributes[schema.OUTPUT_VALUE] = completions[0].text if len(completions) == 1 else "\n\n".join(
                c.text for c in completions)
            attributes[schema.OUTPUT_MIME_TYPE] = "text/plain"
            attributes[schema.COMPLETIONS] = json.dumps([
                {"index": c.index, "token_ids": c.token_ids, "text": c.text, "finish_reason": c.finish_reason}
                for c in completions
            ], ensure_ascii=False)
        self.span.set_attributes(attributes)
        if error is not None:
            reason = self._reason(error)
            self.span.set_attribute(schema.ERROR_REASON, reason)
            self.span.set_status(Status(StatusCode.ERROR, reason))
        elif any(c.finish_reason == "abort" for c in completions):
            self.span.set_status(Status(StatusCode.ERROR, "aborted"))
        self._end()

    def fail(self, error: BaseException) -> None:
        if self._ended:
            return
        reason = self._reason(error)
        if not self.redact_inputs:
            self.span.record_exception(error)
        self.span.set_attribute(schema.ERROR_REASON, reason)
        self.span.set_status(Status(StatusCode.ERROR, reason))
        self._end()

    def _reason(self, error: BaseException) -> str:
        # An error message may quote the input (a bad token id, say): redacted, keep only its type.
        return type(error).__name__ if self.redact_inputs else f"{type(error).__name__}: {error}"

    def _end(self) -> None:
        self._ended = True
        self.span.end()


class DetokenizeClock:
    """`with spans.detokenizing:` around each detokenizer update: the first and last update's
    end (time.time()), how many there were, and the seconds they took together."""

    __slots__ = ("first", "last", "calls", "seconds", "_started")

    def __init__(self) -> None:
        self.first: float | None = None
        self.last = 0.0
        self.calls = 0
        self.seconds = 0.0

    def __enter__(self) -> None:
        self._started = time.perf_counter()

    def __exit__(self, *exc) -> None:
        now = time.time()
        self.seconds += time.perf_counter() - self._started
        self.calls += 1
        self.last = now
        if self.first is None:
            self.first = now


class Sent:
    """What the front end reports from inside `enqueueing` and `sending`: the engine it sent to, and how
    many bytes crossed (None: unknown, or nothing crossed)."""

    __slots__ = ("engine_index", "num_bytes")

    def __init__(self) -> None:
        self.engine_index: int | None = None
        self.num_bytes: int | None = None


def image_attributes(features) -> dict:
    """A prompt's images on a span (its render span, the engine's queue span): content hashes and placeholder runs."""
    if not features:
        return {}
    return {schema.MM_HASHES: [f.identifier for f in features], schema.MM_PLACEHOLDER_OFFSETS: [
        f.offset for f in features], schema.MM_PLACEHOLDER_LENGTHS: [f.length for f in features]}


def _is_pooling(params) -> bool:
    """PoolingParams (a pooling request's), told from SamplingParams by its `task` (this package imports neither)."""
    return hasattr(params, "task")


class _NoSpans:
    """Tracing is off: every call is a no-op."""

    detokenizing = nullcontext()

    def stage(self, name: str, attributes: dict | None = None):
        return nullcontext()

    def carrier(self) -> dict[str, str]:
        return {}

    def enqueueing(self, request_id: str):
        return nullcontext(Sent())

    def sending(self, request_id: str):
        return nullcontext(Sent())

    def _records(self, *args, **kwargs) -> None:
        """A method that only records: nothing to do."""

    log_inputs = pooled = reasoning_read = log_lora = finish = fail = _records


NO_SPANS = _NoSpans()


def start_request_spans(operation: str, model: str, request_id: str, *, redact_inputs: bool = False):
    if not tracing_enabled():
        return NO_SPANS
    return RequestSpans(operation, model, request_id, redact_inputs=redact_inputs)
