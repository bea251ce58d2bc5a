"""Lifecycle tracing end to end: a traced server, its trace files, OTLP export, offline tracing."""

import asyncio
import collections
import http.server
import json
import signal
import threading
from pathlib import Path

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from tests.tiny_checkpoints import tiny_model_with_tokenizer
from tinyserve.lifecycle import schema
from tinyserve.testing import ServerProcess
from tinyserve.trace_reading.otlp_json import read_spans

MODEL = "tiny"
# The spans of one n=1 request: the HTTP root, the request span and eight stages.
SPANS_PER_REQUEST = 2 + len(schema.REQUEST_STAGES)


def run_folder(trace_dir: Path) -> Path:
    [run] = list(trace_dir.iterdir())
    return run


def all_spans(run: Path):
    return [span for path in sorted(run.glob("*.jsonl")) for span in read_spans(path)]


def request_traces(spans) -> dict[str, list]:
    traces = collections.defaultdict(list)
    for span in spans:
        traces[span.trace_id].append(span)
    return {tid: ss for tid, ss in traces.items() if not any(s.name == schema.STEP for s in ss)}


def chat(url, content, **extra):
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 4, "ignore_eos": True, **extra}
    response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60, headers=extra.pop("headers", None))
    assert response.status_code == 200, response.text
    return response


@pytest.fixture(scope="module")
def traced_run(tmp_path_factory):
    trace_dir = tmp_path_factory.mktemp("traces")
    server = ServerProcess(str(tiny_model_with_tokenizer("llama")), "--served-model-name", MODEL, "--trace",
                           "--trace-dir", str(trace_dir), "--num-kv-blocks", "128")
    incoming = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    try:
        chat(server.url, "first")
        httpx.post(f"{server.url}/v1/chat/completions", headers={"traceparent": incoming}, timeout=60,
                   json={"model": MODEL, "messages": [{"role": "user", "content": "continued"}], "max_tokens": 4,
                         "ignore_eos": True})
        stream = {"model": MODEL, "prompt": "streamed", "max_tokens": 4, "stream": True, "ignore_eos": True}
        assert httpx.post(f"{server.url}/v1/completions", json=stream, timeout=60).status_code == 200
    finally:
        server.stop(signal.SIGINT)
    run = run_folder(trace_dir)
    return run, all_spans(run), incoming


@pytest.mark.server
def test_run_folder_has_a_manifest_and_one_file_per_process(traced_run):
    run, _, _ = traced_run
    assert sorted(p.name for p in run.iterdir()) == sorted([schema.API_TRACE_FILE, schema.MANIFEST_FILE, schema.engine_trace_file(0)])
    manifest = json.loads((run / schema.MANIFEST_FILE).read_text())
    assert manifest["served_model_name"] == MODEL and manifest["engine_args"]["num_kv_blocks"] == 128


@pytest.mark.server
def test_each_request_trace_has_every_stage_once_and_one_root(traced_run):
    _, spans, _ = traced_run
    traces = request_traces(spans)
    assert len(traces) == 3
    for trace_spans in traces.values():
        names = collections.Counter(s.name for s in trace_spans)
        for stage in schema.REQUEST_STAGES:
            assert names[stage] == 1, (stage, names)
        ids = {s.span_id for s in trace_spans}
        roots = [s for s in trace_spans if s.parent_span_id not in ids]
        assert len(roots) == 1 and roots[0].name.startswith("POST /v1/")
        assert {s.service for s in trace_spans} == {schema.SERVICE_API, schema.engine_service_name(0)}
        [send] = [s for s in trace_spans if s.name == schema.IPC_SEND]  # the size of the message that crossed
        assert send.attributes[schema.IPC_BYTES] > 0 and send.attributes[schema.ENGINE_INDEX] == 0


@pytest.mark.server
def test_engine_spans_are_children_of_the_request_span_across_processes(traced_run):
    _, spans, _ = traced_run
    for trace_spans in request_traces(spans).values():
        [request_span] = [s for s in trace_spans if s.name.startswith(("chat ", "text_completion "))]
        for span in trace_spans:
            if span.name in schema.ENGINE_STAGES:
                assert span.service == schema.engine_service_name(0)
                assert span.parent_span_id == request_span.span_id
        queue, prefill, decode = (next(s for s in trace_spans if s.name == n) for n in schema.ENGINE_STAGES)
        assert queue.end_ns <= prefill.start_ns + 1 and prefill.end_ns <= decode.start_ns + 1
        assert len(decode.attributes[schema.TOKEN_TIMES]) == decode.attributes[schema.NUM_OUTPUT_TOKENS] == 4
        assert prefill.events and prefill.events[0].name == schema.EVENT_PREFILL_CHUNK


@pytest.mark.server
def test_the_request_span_carries_what_llm_viewers_show_as_input_and_output(traced_run):
    _, spans, _ = traced_run
    chats = [s for s in spans if s.name == f"chat {MODEL}"]
    inputs = [json.loads(s.attributes[schema.INPUT_VALUE]) for s in chats]
    assert [m[-1]["content"] for m in inputs] == ["first", "continued"]
    assert all(s.attributes[schema.INPUT_MIME_TYPE] == "application/json" for s in chats)
    assert all(s.attributes[schema.OUTPUT_VALUE] == s.attributes[schema.OUTPUT_TEXT] for s in chats)
    [completion] = [s for s in spans if s.name == f"text_completion {MODEL}"]
    assert completion.attributes[schema.INPUT_VALUE] == "streamed"


@pytest.mark.server
def test_request_span_logs_inputs_and_outputs_for_replay(traced_run):
    _, spans, _ = traced_run
    for trace_spans in request_traces(spans).values():
        [request_span] = [s for s in trace_spans if s.name.startswith(("chat ", "text_completion "))]
        [render] = [s for s in trace_spans if s.name == schema.RENDER]
        assert request_span.attributes[schema.GEN_AI_PROVIDER_NAME] == "tinyserve"
        assert request_span.attributes[schema.GEN_AI_USAGE_OUTPUT_TOKENS] == 4
        assert request_span.attributes[schema.GEN_AI_RESPONSE_FINISH_REASONS] == ["length"]
        assert len(request_span.attributes[schema.OUTPUT_TOKEN_IDS]) == 4
        assert render.attributes[schema.PROMPT_TOKEN_IDS] and json.loads(render.attributes[schema.SAMPLING_PARAMS])["max_tokens"] == 4


@pytest.mark.server
def test_incoming_traceparent_is_continued(traced_run):
    _, spans, incoming = traced_run
    _, trace_id, parent_id, _ = incoming.split("-")
    continued = [s for s in spans if s.trace_id == trace_id]
    assert continued
    [root] = [s for s in continued if s.name == "POST /v1/chat/completions"]
    assert root.parent_span_id == parent_id


@pytest.mark.server
def test_step_spans_link_to_the_requests_they_served_and_carry_the_batch(traced_run):
    _, spans, _ = traced_run
    request_span_of = {s.attributes[schema.REQUEST_ID]: s.span_id for s in spans
                       if s.name.startswith(("chat ", "text_completion "))}
    steps = [s for s in spans if s.name == schema.STEP]
    assert steps
    children = collections.Counter(s.name for s in spans if s.name in (schema.SCHEDULE, schema.EXECUTE, schema.UPDATE))
    assert children == {schema.SCHEDULE: len(steps), schema.EXECUTE: len(steps), schema.UPDATE: len(steps)}
    for step in steps:
        attributes = step.attributes
        assert len(attributes[schema.STEP_REQUEST_IDS]) == len(attributes[schema.STEP_TOKENS_PER_REQUEST])
        # One link per request served, in the order of the step's request ids; a step that served none
        # is there only to release the blocks of requests that finished while nothing else ran.
        assert [link.span_id for link in step.links] == [
            request_span_of[request_id] for request_id in attributes[schema.STEP_REQUEST_IDS]]
        assert step.links or attributes[schema.STEP_RELEASED_REQUEST_IDS]
        assert attributes[schema.KV_BLOCKS_USED] + attributes[schema.KV_BLOCKS_FREE] == attributes[schema.KV_BLOCKS_TOTAL] == 128
        assert attributes[schema.STEP_NUM_PREFILL_TOKENS] + attributes[schema.STEP_NUM_DECODE_TOKENS] == sum(
            attributes[schema.STEP_TOKENS_PER_REQUEST])


async def _burst(url: str, count: int) -> list[int]:
    async with httpx.AsyncClient(timeout=120) as client:
        async def one(i):
            body = {"model": MODEL, "prompt": f"request {i}", "max_tokens": 3, "ignore_eos": True}
            return (await client.post(f"{url}/v1/completions", json=body)).status_code
        return await asyncio.gather(*[one(i) for i in range(count)])


@pytest.mark.server
def test_no_span_is_lost_under_load(tmp_path):
    server = ServerProcess(str(tiny_model_with_tokenizer("llama")), "--served-model-name", MODEL, "--trace",
                           "--trace-dir", str(tmp_path), "--num-kv-blocks", "512")
    try:
        statuses = asyncio.run(_burst(server.url, 200))
    finally:
        server.stop(signal.SIGTERM)
    assert statuses == [200] * 200
    spans = all_spans(run_folder(tmp_path))
    traces = request_traces(spans)
    assert len(traces) == 200
    assert all(len(trace_spans) == SPANS_PER_REQUEST for trace_spans in traces.values())
    steps = [s for s in spans if s.name == schema.STEP]
    served = collections.Counter(rid for step in steps for rid in step.attributes[schema.STEP_REQUEST_IDS])
    assert len(served) == 200


class _OTLPReceiver(http.server.BaseHTTPRequestHandler):
    received: list = []  # one dict per span: service, name, ids, attributes, links

    def do_POST(self):  # noqa: N802 (http.server's naming)
        body = self.rfile.read(int(self.headers["Content-Length"]))
        request = ExportTraceServiceRequest()
        request.ParseFromString(body)
        for resource_spans in request.resource_spans:
            service = next(a.value.string_value for a in resource_spans.resource.attributes if a.key == "service.name")
            for scope_spans in resource_spans.scope_spans:
                self.received += [{
                    "service": service, "name": span.name, "trace_id": span.trace_id.hex(),
                    "span_id": span.span_id.hex(), "parent": span.parent_span_id.hex() or None,
                    "attributes": {a.key: _value(a.value) for a in span.attributes},
                    "links": [(link.trace_id.hex(), link.span_id.hex()) for link in span.links],
                } for span in scope_spans.spans]
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.end_headers()

    def log_message(self, *args):
        pass


def _value(value):
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in value.array_value.values]
    return getattr(value, kind)


@pytest.mark.server
def test_otlp_viewers_list_one_trace_per_request_and_one_timeline_per_engine_with_genai_attributes():
    """What an OTLP viewer (Phoenix, Jaeger, Langfuse) receives: a trace per request, whose LLM span carries
    the GenAI and OpenInference attributes it displays, and the engine's steps under one timeline trace
    (per TIMELINE_WINDOW_S), linked both ways. --trace-redact-inputs keeps the prompt and output text out."""
    receiver = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _OTLPReceiver)
    threading.Thread(target=receiver.serve_forever, daemon=True).start()
    endpoint = f"http://127.0.0.1:{receiver.server_address[1]}"
    server = ServerProcess(str(tiny_model_with_tokenizer("llama")), "--served-model-name", MODEL,
                           "--otlp-endpoint", endpoint, "--num-kv-blocks", "64", "--trace-redact-inputs")
    try:
        for content in ("exported", "and again", "a third"):
            chat(server.url, content)
    finally:
        server.stop(signal.SIGTERM)
        receiver.shutdown()
    spans = _OTLPReceiver.received
    assert {(schema.SERVICE_API, f"chat {MODEL}"), (schema.engine_service_name(0), schema.DECODE),
            (schema.engine_service_name(0), schema.STEP)} <= {(s["service"], s["name"]) for s in spans}
    roots = collections.Counter(s["name"] for s in spans if s["parent"] is None)
    assert set(roots) == {"POST /v1/chat/completions", schema.ENGINE_TIMELINE}
    assert roots["POST /v1/chat/completions"] == 3 and roots[schema.ENGINE_TIMELINE] == 1  # 4 traces in all
    assert len({s["trace_id"] for s in spans}) == 4
    [timeline] = [s for s in spans if s["name"] == schema.ENGINE_TIMELINE]
    steps = [s for s in spans if s["name"] == schema.STEP]
    assert steps and all(s["parent"] == timeline["span_id"] for s in steps)
    requests = [s for s in spans if s["name"] == f"chat {MODEL}"]
    for request in requests:
        attributes = request["attributes"]
        assert attributes[schema.OPENINFERENCE_SPAN_KIND] == "LLM" and attributes[schema.LLM_MODEL_NAME] == MODEL
        assert attributes[schema.GEN_AI_USAGE_OUTPUT_TOKENS] == attributes[schema.LLM_TOKEN_COUNT_COMPLETION] == 4
        assert attributes[schema.LLM_TOKEN_COUNT_TOTAL] == attributes[schema.GEN_AI_USAGE_INPUT_TOKENS] + 4
        assert attributes[schema.GEN_AI_RESPONSE_FINISH_REASONS] == ["length"]
        assert schema.INPUT_VALUE not in attributes and schema.OUTPUT_VALUE not in attributes  # redacted
        decode = next(s for s in spans if s["name"] == schema.DECODE and s["trace_id"] == request["trace_id"])
        assert (timeline["trace_id"], timeline["span_id"]) in decode["links"]  # the request → its timeline
        assert any((request["trace_id"], request["span_id"]) in step["links"] for step in steps)  # and back


def test_offline_llm_traces_the_stages_that_exist_in_process(tmp_path):
    from tinyserve import LLM, SamplingParams
    from tinyserve.lifecycle.tracing import shutdown_tracing

    try:
        llm = LLM(str(tiny_model_with_tokenizer("llama")), trace_dir=str(tmp_path), num_kv_blocks=64)
        llm.generate(["one", "two"], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
        run = run_folder(tmp_path)
        spans = read_spans(run / schema.OFFLINE_TRACE_FILE)
    finally:
        shutdown_tracing()
    traces = request_traces(spans)
    assert len(traces) == 2
    for trace_spans in traces.values():
        names = sorted(s.name for s in trace_spans)
        expected = [f"text_completion {llm.model_name}", schema.DECODE, schema.DETOKENIZE, schema.ENQUEUE,
                    schema.PREFILL, schema.QUEUE, schema.RENDER]
        assert names == sorted(expected)
        assert {s.service for s in trace_spans} == {schema.SERVICE_OFFLINE}


def test_an_interrupted_offline_run_keeps_the_spans_of_the_steps_that_ran(tmp_path):
    # Offline, engine spans are built after the loop; an interrupt (Ctrl-C in a notebook)
    # must not take the steps that did run out of the trace.
    from tinyserve import LLM, SamplingParams
    from tinyserve.lifecycle.tracing import shutdown_tracing

    try:
        llm = LLM(str(tiny_model_with_tokenizer("llama")), trace_dir=str(tmp_path), num_kv_blocks=64)
        step, steps_run = llm.engine_core.step_fn, []  # the step the engine's loop calls

        def step_then_interrupt():
            if len(steps_run) == 5:
                raise KeyboardInterrupt
            steps_run.append(step())
            return steps_run[-1]

        llm.engine_core.step_fn = step_then_interrupt
        with pytest.raises(KeyboardInterrupt):
            llm.generate(["one", "two"], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
                         use_tqdm=False)
        spans = read_spans(run_folder(tmp_path) / schema.OFFLINE_TRACE_FILE)
    finally:
        shutdown_tracing()
    step_ids = sorted(s.attributes[schema.STEP_ID] for s in spans if s.name == schema.STEP)
    assert len(step_ids) == 5 and step_ids == list(range(step_ids[0], step_ids[0] + 5))
    assert collections.Counter(s.name for s in spans if s.name in (schema.SCHEDULE, schema.EXECUTE)) == {
        schema.SCHEDULE: 5, schema.EXECUTE: 5}


def test_the_detokenize_span_counts_the_updates_and_names_the_stop_string_that_ended_the_request(tmp_path):
    from tinyserve import LLM, SamplingParams
    from tinyserve.lifecycle.tracing import shutdown_tracing

    try:
        llm = LLM(str(tiny_model_with_tokenizer("llama")), trace_dir=str(tmp_path), num_kv_blocks=64)
        [plain] = llm.generate(["one"], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
        text = plain.outputs[0].text
        stop = text[len(text) // 2:][:2]
        [stopped] = llm.generate(["one"], SamplingParams(temperature=0, max_tokens=12, stop=[stop]), use_tqdm=False)
        spans = read_spans(run_folder(tmp_path) / schema.OFFLINE_TRACE_FILE)
    finally:
        shutdown_tracing()
    assert stop.strip() and (stopped.outputs[0].finish_reason, stopped.outputs[0].stop_reason) == ("stop", stop)
    detokenize = {s.trace_id: s for s in spans if s.name == schema.DETOKENIZE}
    by_request = {s.attributes[schema.REQUEST_ID]: s.trace_id for s in spans if s.name.startswith("text_completion")}
    assert len(detokenize) == len(by_request) == 2
    first, second = (detokenize[trace_id] for trace_id in by_request.values())
    assert schema.STOP_STRING not in first.attributes and second.attributes[schema.STOP_STRING] == stop
    assert first.attributes[schema.DETOKENIZE_CALLS] == 12  # one update per engine output: one token a step
    assert 0 < second.attributes[schema.DETOKENIZE_CALLS] <= 12 and first.attributes[schema.DETOKENIZE_TIME] > 0
