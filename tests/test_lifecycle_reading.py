"""The trace readers: load_run, summarize, the Jaeger/Perfetto exports, plots, replay, `tinyserve trace`.

Most tests read the demo run of tests/synthetic_trace.py, whose timestamps are
round milliseconds, so every metric is checked against a value computed by hand
from the picture in that file. Replay runs a real tiny model.
"""

import json
from collections import defaultdict

import numpy as np
import pytest
from matplotlib.figure import Figure

from tests.synthetic_trace import (
    DEMO_REQUESTS, DEMO_STEPS, T0_NS, SyntheticRequest, SyntheticSequence, SyntheticStep, ns, write_demo_run, write_run,
)
from tests.tiny_checkpoints import tiny_model_with_tokenizer
from tinyserve import LLM, SamplingParams
from tinyserve.cli.main import main
from tinyserve.lifecycle import schema
from tinyserve.trace_reading import plots
from tinyserve.trace_reading.export import to_jaeger, to_perfetto
from tinyserve.trace_reading.otlp_json import STATUS_ERROR, read_spans
from tinyserve.trace_reading.replay import Divergence, first_divergence, replay_run
from tinyserve.trace_reading.run import load_run
from tinyserve.trace_reading.summary import percentile, summarize

MS = 1e-3


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    return write_demo_run(tmp_path_factory.mktemp("runs") / "demo")


@pytest.fixture(scope="module")
def run(demo_dir):
    return load_run(demo_dir)


def spans_in_demo() -> int:
    # per request: HTTP, request, render, enqueue, detokenize, respond; per completion: ipc.send, queue,
    # prefill, decode; per step: step, schedule, execute, update
    return 6 * len(DEMO_REQUESTS) + 4 * sum(len(r.sequences) for r in DEMO_REQUESTS) + 4 * len(DEMO_STEPS)


# ---- reading OTLP/JSON ------------------------------------------------------------------------


def test_otlp_reader_decodes_what_the_opentelemetry_sdk_writes(tmp_path):
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.trace import Link, SpanKind, Status, StatusCode, set_span_in_context

    from tinyserve.lifecycle.otlp_file import OTLPJsonFileExporter

    provider = TracerProvider(resource=Resource.create({"service.name": "tinyserve-engine-2"}))
    provider.add_span_processor(SimpleSpanProcessor(OTLPJsonFileExporter(tmp_path / "engine-2.jsonl")))
    tracer = provider.get_tracer("tinyserve")
    attributes = {"i": 0, "big": 2**62, "f": 1.5, "b": False, "s": "x", "ints": [1, 2, 3], "empty": []}
    root = tracer.start_span("root", kind=SpanKind.SERVER, attributes=attributes, start_time=10_000)
    root.add_event("prefill_chunk", {"tinyserve.chunk_tokens": 7}, timestamp=11_000)
    child = tracer.start_span("child", context=set_span_in_context(root), links=[Link(root.get_span_context())],
                              start_time=12_000)
    child.set_status(Status(StatusCode.ERROR, "boom"))
    child.end(end_time=13_000)
    root.end(end_time=20_000)
    provider.shutdown()

    spans = {s.name: s for s in read_spans(tmp_path / "engine-2.jsonl")}
    root_context = root.get_span_context()
    assert spans["root"].trace_id == f"{root_context.trace_id:032x}"
    assert spans["root"].span_id == f"{root_context.span_id:016x}"
    assert spans["root"].parent_span_id is None
    assert spans["root"].attributes == attributes
    assert (spans["root"].start_ns, spans["root"].end_ns, spans["root"].kind_name) == (10_000, 20_000, "server")
    assert spans["root"].service == "tinyserve-engine-2"
    assert [(e.name, e.time_ns, e.attributes) for e in spans["root"].events] == [("prefill_chunk", 11_000, {"tinyserve.chunk_tokens": 7})]
    assert spans["child"].parent_span_id == spans["root"].span_id
    assert [(link.trace_id, link.span_id) for link in spans["child"].links] == [(spans["root"].trace_id, spans["root"].span_id)]
    assert (spans["child"].status.code, spans["child"].status.message) == (STATUS_ERROR, "boom")


def test_truncated_last_line_is_skipped_with_a_warning(tmp_path):
    folder = write_demo_run(tmp_path / "crashed")
    engine_file = folder / schema.engine_trace_file(1)
    lines = engine_file.read_text().splitlines()
    lost = len(json.loads(lines[-1])["resourceSpans"][0]["scopeSpans"][0]["spans"])
    engine_file.write_text("\n".join(lines[:-1] + [lines[-1][: len(lines[-1]) // 2]]) + "\n")
    with pytest.warns(UserWarning, match="engine-1.jsonl.*incomplete"):
        run = load_run(folder)
    assert len(run.spans) == spans_in_demo() - lost


def test_a_broken_line_before_the_last_is_an_error(tmp_path):
    folder = write_demo_run(tmp_path / "damaged")
    api_file = folder / schema.API_TRACE_FILE
    lines = api_file.read_text().splitlines()
    api_file.write_text("\n".join([lines[0][:20], *lines[1:]]) + "\n")
    with pytest.raises(ValueError, match=r"api.jsonl:1 "):
        load_run(folder)


def test_a_folder_without_a_manifest_is_not_a_run(tmp_path):
    with pytest.raises(ValueError, match="no manifest.json"):
        load_run(tmp_path)
    with pytest.raises(ValueError, match="no such directory"):
        load_run(tmp_path / "missing")


# ---- timelines and metrics ---------------------------------------------------------------------


def test_load_run_builds_one_timeline_per_request_with_its_completions(run):
    assert len(run.spans) == spans_in_demo()
    assert [r.request_id for r in run.requests] == ["chatcmpl-a", "cmpl-b", "chatcmpl-c"]
    assert [r.operation for r in run.requests] == ["chat", "text_completion", "chat"]
    assert [r.engine_index for r in run.requests] == [0, 1, 0]
    b = run.request("cmpl-b")
    assert [s.request_id for s in b.sequences] == ["0_cmpl-b", "1_cmpl-b"]
    assert set(b.stages) == {schema.RENDER, schema.ENQUEUE, schema.DETOKENIZE, schema.RESPOND}
    # each completion is sent on its own, then queued, prefilled and decoded
    assert all(set(s.stages) == {schema.IPC_SEND, *schema.ENGINE_STAGES} for s in b.sequences)
    assert b.http_span.name == "POST /v1/completions"
    assert b.stages[schema.RESPOND].parent_span_id == b.http_span.span_id


def test_latency_metrics_match_hand_computed_values(run):
    a, b, c = run.requests
    # a: arrives 0, tokens at 15 25 35 45, done 60
    assert a.ttft_s == pytest.approx(15 * MS)
    assert a.tpot_s == pytest.approx(10 * MS)
    assert a.itls_s == pytest.approx([10 * MS] * 3)
    assert a.e2e_s == pytest.approx(60 * MS)
    # b: arrives 10; completions' tokens at 20 26 32 and 22 30 40: first token 20, TPOT (12 + 18) / (2 + 2)
    assert b.ttft_s == pytest.approx(10 * MS)
    assert b.tpot_s == pytest.approx(7.5 * MS)
    assert sorted(b.itls_s) == pytest.approx([6 * MS, 6 * MS, 8 * MS, 10 * MS])
    assert [s.tpot_s for s in b.sequences] == pytest.approx([6 * MS, 9 * MS])
    # c: arrives 30, tokens at 40 44
    assert (c.ttft_s, c.tpot_s, c.e2e_s) == pytest.approx((10 * MS, 4 * MS, 20 * MS))


def test_engine_stages_and_events_come_from_the_engine_spans(run):
    a = run.request("chatcmpl-a").sequences[0]
    assert (a.duration_s(schema.QUEUE), a.duration_s(schema.PREFILL), a.duration_s(schema.DECODE)) == pytest.approx(
        (2 * MS, 10 * MS, 30 * MS))
    assert a.prefill_chunks == [(ns(10.0), 6), (ns(15.0), 4)]
    assert a.token_times_ns == [ns(t) for t in (15.0, 25.0, 35.0, 45.0)]
    first, second = run.request("cmpl-b").sequences
    assert (first.num_preemptions, first.preemption_times_ns) == (1, [ns(24.0)])
    assert second.num_preemptions == 0
    # With n > 1 a request's stage duration is its slowest completion's.
    assert run.request("cmpl-b").stage_duration_s(schema.QUEUE) == pytest.approx(2.5 * MS)


def test_logged_inputs_and_outputs_are_decoded(run):
    a = run.request("chatcmpl-a")
    assert a.inputs.messages == [{"role": "user", "content": "hi"}]
    assert a.inputs.prompt == "<user>hi</user>"
    assert a.inputs.prompt_token_ids == list(range(1, 11))
    assert a.inputs.sampling_params == {"temperature": 0.0, "max_tokens": 4}
    assert [(c.index, c.token_ids, c.text, c.finish_reason) for c in run.request("cmpl-b").completions] == [
        (0, [21, 22, 23], "xyz", "length"), (1, [31, 32, 33], "uvw", "length")]
    c = run.request("chatcmpl-c")
    assert c.inputs.redacted and c.inputs.prompt_token_ids is None and c.inputs.sampling_params is None


def test_step_records_carry_batch_kv_and_phase_times(run):
    assert [(s.engine_index, s.step_id) for s in run.steps] == [(0, 0), (0, 1), (1, 0), (1, 1), (0, 2)]
    step = run.engine_steps(1)[1]
    assert step.request_ids == ["0_cmpl-b", "1_cmpl-b"] and step.num_tokens_per_request == [1, 5]
    assert (step.num_prefill_requests, step.num_decode_requests, step.num_prefill_tokens, step.num_decode_tokens) == (1, 1, 5, 1)
    assert (step.kv_blocks_used, step.kv_blocks_free, step.kv_blocks_total, step.kv_usage) == (4, 0, 4, 1.0)
    assert (step.num_waiting, step.num_running, step.preempted_request_ids) == (1, 2, ["0_cmpl-b"])
    # the writer splits a 2 ms step 10% / 80% / 10%
    assert (step.schedule_s, step.execute_s, step.update_s) == pytest.approx((0.2 * MS, 1.6 * MS, 0.2 * MS))
    assert step.duration_s == pytest.approx(2 * MS)


def test_to_records_are_flat_rows(run):
    requests, steps = run.requests.to_records(), run.steps.to_records()
    assert len(requests) == 3 and len(steps) == 5
    for row in requests + steps:
        for value in row.values():
            assert value is None or isinstance(value, (int, float, str, bool)) or (
                isinstance(value, list) and all(isinstance(v, (int, str)) for v in value))
    a = requests[0]
    assert a["request_id"] == "chatcmpl-a" and a["ttft_s"] == pytest.approx(15 * MS)
    assert (a["render_s"], a["ipc_send_s"], a["queue_s"], a["prefill_s"], a["decode_s"]) == pytest.approx(
        (1 * MS, 0.1 * MS, 2 * MS, 10 * MS, 30 * MS))
    assert (a["num_prompt_tokens"], a["num_output_tokens"], a["http_status_code"]) == (10, 4, 200)
    assert steps[3]["kv_usage"] == 1.0 and steps[3]["num_requests"] == 2


def test_request_lookup_by_client_or_engine_id(run):
    assert run.request("1_cmpl-b").request_id == "cmpl-b"
    with pytest.raises(ValueError, match="request_id 'nope' is not in run demo"):
        run.request("nope")


# ---- summary -------------------------------------------------------------------------------------


def test_percentile_matches_numpy():
    values = [3.0, 1.0, 4.0, 1.5, 9.0, 2.6]
    for q in (0, 50, 90, 99, 100):
        assert percentile(values, q) == pytest.approx(np.percentile(values, q))


def test_summary_has_metrics_stages_and_engines(run):
    text = summarize(run)
    for label in ("TTFT", "TPOT", "ITL", "E2E", *schema.REQUEST_STAGES, schema.STEP, schema.EXECUTE):
        assert label in text
    ttft = next(line for line in text.splitlines() if line.startswith("TTFT")).split()
    assert ttft[1:] == ["3", "11.67", "10.00", "14.00", "14.90"]  # TTFTs 15, 10, 10 ms
    engine_1 = next(line for line in text.splitlines() if line.startswith("engine 1")).split()
    # 2 completions, 2 steps, batch 1 then 2 requests (6 tokens each), KV full once, one preemption
    assert engine_1[2:4] == ["2", "2"] and "100%" in engine_1 and engine_1[-1] == "1"


def test_cli_summarize_prints_the_summary(demo_dir, capsys):
    assert main(["trace", "summarize", str(demo_dir)]) == 0
    assert "tinyserve.prefill" in capsys.readouterr().out
    assert main(["trace", "summarize", str(demo_dir / "missing")]) == 1


# ---- exports -------------------------------------------------------------------------------------


def test_jaeger_export_holds_every_span_with_references(run):
    document = to_jaeger(run)
    jaeger_spans = {s["spanID"]: (trace, s) for trace in document["data"] for s in trace["spans"]}
    assert len(jaeger_spans) == len(run.spans) == spans_in_demo()
    for span in run.spans:
        trace, exported = jaeger_spans[span.span_id]
        assert exported["traceID"] == trace["traceID"] == span.trace_id
        assert exported["operationName"] == span.name
        assert exported["startTime"] == span.start_ns // 1000
        assert exported["duration"] == span.end_ns // 1000 - span.start_ns // 1000
        assert trace["processes"][exported["processID"]]["serviceName"] == span.service
        child_of = [r["spanID"] for r in exported["references"] if r["refType"] == "CHILD_OF"]
        assert child_of == ([span.parent_span_id] if span.parent_span_id else [])
        follows = [(r["traceID"], r["spanID"]) for r in exported["references"] if r["refType"] == "FOLLOWS_FROM"]
        assert follows == [(link.trace_id, link.span_id) for link in span.links]
    a_request = jaeger_spans[run.request("chatcmpl-a").request_span.span_id][1]
    assert (a_request["startTime"], a_request["duration"]) == (T0_NS // 1000, 60_000)
    tags = {t["key"]: t for t in a_request["tags"]}
    assert tags[schema.GEN_AI_USAGE_OUTPUT_TOKENS] == {"key": schema.GEN_AI_USAGE_OUTPUT_TOKENS, "type": "int64", "value": 4}
    assert json.loads(tags[schema.OUTPUT_TOKEN_IDS]["value"]) == [11, 12, 13, 14]
    step_links = [r for trace, s in jaeger_spans.values() for r in s["references"] if r["refType"] == "FOLLOWS_FROM"]
    assert len(step_links) == sum(len(s.request_ids) for s in DEMO_STEPS)
    prefill = jaeger_spans[run.request("chatcmpl-a").sequences[0].prefill.span_id][1]
    assert [log["timestamp"] for log in prefill["logs"]] == [ns(10.0) // 1000, ns(15.0) // 1000]


def test_perfetto_export_tracks_slices_counters_and_flows(run):
    events = to_perfetto(run)["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert sorted(names.values()) == sorted({schema.SERVICE_API, schema.engine_service_name(0), schema.engine_service_name(1)})
    pid_of = {service: pid for pid, service in names.items()}
    # async slices: per (pid, cat, id) the b/e pairs nest like a stack, in time order
    stacks, last_ts, begins = defaultdict(list), defaultdict(float), defaultdict(int)
    for e in events:
        if e["ph"] in "be":
            key = (e["pid"], e["cat"], e["id"])
            assert e["ts"] >= last_ts[key]
            last_ts[key] = e["ts"]
            if e["ph"] == "b":
                stacks[key].append(e["name"])
                begins[e["name"]] += 1
            else:
                assert stacks[key].pop() == e["name"]
    assert all(not stack for stack in stacks.values())
    request_spans = [s for s in run.spans if s.trace_id in {r.trace_id for r in run.requests}]
    assert sum(begins.values()) == len(request_spans)
    queue = next(e for e in events if e["ph"] == "b" and e["name"] == schema.QUEUE and e["args"][schema.REQUEST_ID] == "chatcmpl-a")
    assert queue["pid"] == pid_of[schema.engine_service_name(0)]
    assert queue["ts"] == pytest.approx(3500.0)  # µs after the first span (a's HTTP span, at -0.5 ms)
    # engine steps: complete slices with their three phases, on the engine's track
    steps = [e for e in events if e["ph"] == "X"]
    assert len(steps) == 4 * len(DEMO_STEPS)
    assert {e["pid"] for e in steps} == {pid_of[schema.engine_service_name(0)], pid_of[schema.engine_service_name(1)]}
    assert sum(e["name"] == schema.STEP for e in steps) == len(DEMO_STEPS)
    step = next(e for e in steps if e["name"] == schema.STEP and e["args"][schema.STEP_ID] == 1
                and e["pid"] == pid_of[schema.engine_service_name(1)])
    assert (step["ts"], step["dur"]) == pytest.approx((20_500.0, 2_000.0))
    counters = [e for e in events if e["ph"] == "C"]
    kv = [e["args"] for e in counters if e["name"] == "KV cache blocks" and e["pid"] == pid_of[schema.engine_service_name(1)]]
    assert kv == [{"used": 1, "total": 4}, {"used": 4, "total": 4}]
    assert any(e["name"] == "batch tokens" for e in counters)
    # one arrow per completion: from its ipc.send (api) to its queue (engine), matched by bind_id
    out = {e["bind_id"]: e for e in events if e.get("flow_out")}
    into = {e["bind_id"]: e for e in events if e.get("flow_in")}
    assert len(out) == len(into) == sum(len(r.sequences) for r in DEMO_REQUESTS) and out.keys() == into.keys()
    for bind_id, source in out.items():
        assert (source["name"], source["pid"]) == (schema.IPC_SEND, pid_of[schema.SERVICE_API])
        target = into[bind_id]
        assert target["name"] == schema.QUEUE and target["pid"] != source["pid"]
        assert target["args"][schema.REQUEST_ID] == source["args"][schema.REQUEST_ID]


@pytest.mark.parametrize("format", ["jaeger", "perfetto"])
def test_cli_export_writes_json(demo_dir, tmp_path, format):
    out = tmp_path / f"{format}.json"
    assert main(["trace", "export", str(demo_dir), "--format", format, "-o", str(out)]) == 0
    document = json.loads(out.read_text())
    assert "data" in document if format == "jaeger" else document["displayTimeUnit"] == "ms"


# ---- plots -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("plot", [plots.plot_request_waterfall, plots.plot_latency_histograms, plots.plot_batch_composition,
                                  plots.plot_kv_usage, plots.plot_stage_breakdown, plots.plot_requests_timeline])
def test_plots_return_labelled_figures(run, plot):
    figure = plot(run)
    assert isinstance(figure, Figure)
    main_axes = [ax for ax in figure.axes if ax.get_xlabel()]  # twin axes share the x label of their host
    assert main_axes
    for ax in main_axes:
        assert ax.get_ylabel() and ax.get_title()


def test_waterfall_draws_every_span_of_the_request(run):
    request = run.request("cmpl-b")
    ax = plots.plot_request_waterfall(run, "cmpl-b").axes[0]
    labels = [t.get_text() for t in ax.get_yticklabels()]
    assert len(labels) == 2 + len(request.stage_spans())
    assert "tinyserve.decode [completion 1]" in labels and "ms" in ax.get_xlabel()


def test_cli_plot_writes_four_pngs(demo_dir, tmp_path):
    assert main(["trace", "plot", str(demo_dir), "-o", str(tmp_path / "pngs")]) == 0
    pngs = sorted(tmp_path.joinpath("pngs").glob("*.png"))
    assert [p.stem for p in pngs] == sorted(["request_waterfall", "latency_histograms", "batch_composition", "kv_usage"])
    for png in pngs:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000


# ---- replay --------------------------------------------------------------------------------------------


def test_first_divergence_reports_changed_missing_and_extra_tokens():
    assert first_divergence([[1, 2, 3]], [[1, 2, 3]]) is None
    assert first_divergence([[1, 2, 3]], [[1, 5, 3]]) == Divergence(0, 1, 2, 5)
    assert first_divergence([[1, 2, 3]], [[1, 2]]) == Divergence(0, 2, 3, None)
    assert first_divergence([[1], [4, 5]], [[1], [4, 5, 6]]) == Divergence(1, 2, None, 6)


@pytest.fixture(scope="module")
def model_path():
    return tiny_model_with_tokenizer("llama")


@pytest.fixture(scope="module")
def llm(model_path):
    return LLM(str(model_path), num_kv_blocks=64)


def _logged(request_id: str, prompt: list[int], params: SamplingParams, token_ids: list[list[int]], redacted=False):
    """A logged offline request whose completions are `token_ids`."""
    completions = [{"index": i, "token_ids": ids, "text": "", "finish_reason": "length"} for i, ids in enumerate(token_ids)]
    sequences = [SyntheticSequence(f"{i}_{request_id}" if len(token_ids) > 1 else request_id, 0, 1.0, 2.0,
                                   [3.0 + k for k in range(len(ids))]) for i, ids in enumerate(token_ids)]
    return SyntheticRequest(request_id, schema.OPERATION_TEXT_COMPLETION, 0.0, 20.0, prompt, params, completions, sequences,
                            redacted=redacted)


@pytest.fixture(scope="module")
def real_outputs(llm):
    """What the tiny model really generates: greedy, and seeded sampling with n=2."""
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    seeded = SamplingParams(n=2, temperature=0.8, seed=11, max_tokens=5, ignore_eos=True)
    prompts = [[5, 17, 42, 99, 3], [7, 8, 9, 10, 11, 12]]
    [first] = llm.generate([{"prompt_token_ids": prompts[0]}], greedy, use_tqdm=False)
    [second] = llm.generate([{"prompt_token_ids": prompts[1]}], seeded, use_tqdm=False)
    return [(prompts[0], greedy, [list(c.token_ids) for c in first.outputs]),
            (prompts[1], seeded, [list(c.token_ids) for c in second.outputs])]


def _write_replay_run(folder, model_path, real_outputs, tamper: bool = False):
    (greedy_prompt, greedy, greedy_ids), (seeded_prompt, seeded, seeded_ids) = real_outputs
    if tamper:
        greedy_ids = [greedy_ids[0][:2] + [greedy_ids[0][2] + 1] + greedy_ids[0][3:]]
    requests = [
        _logged("cmpl-greedy", greedy_prompt, greedy, greedy_ids),
        _logged("cmpl-seeded", seeded_prompt, seeded, seeded_ids),
        _logged("cmpl-unseeded", seeded_prompt, SamplingParams(temperature=0.8, max_tokens=5), [seeded_ids[0]]),
        _logged("cmpl-redacted", greedy_prompt, greedy, greedy_ids, redacted=True),
    ]
    for i, request in enumerate(requests):  # one after the other
        request.arrival_ms, request.finished_ms = 30.0 * i, 30.0 * i + 20.0
    # as LLM(trace_dir=...) writes them: every EngineArgs field, tracing ones included
    engine_args = {"model": str(model_path), "num_kv_blocks": 64, "block_size": 16, "trace_run_dir": str(folder),
                   "otlp_endpoint": None}
    return write_run(folder, requests, [], offline=True, model=str(model_path), engine_args=engine_args)


def test_replay_matches_the_logged_outputs_and_skips_what_cannot_be_reproduced(tmp_path, model_path, llm, real_outputs):
    run = load_run(_write_replay_run(tmp_path / "offline", model_path, real_outputs))
    assert {s.service for s in run.spans} == {schema.SERVICE_OFFLINE}
    results = replay_run(run, llm)
    assert [(r.request_id, r.matched, r.skipped) for r in results] == [
        ("cmpl-greedy", True, False), ("cmpl-seeded", True, False),
        ("cmpl-unseeded", False, True), ("cmpl-redacted", False, True)]
    assert "without a seed" in results[2].skipped_reason and "redacted" in results[3].skipped_reason
    assert [r.describe() for r in results[:2]] == ["cmpl-greedy match", "cmpl-seeded match"]


def test_replay_reports_where_a_tampered_output_diverges(tmp_path, model_path, llm, real_outputs):
    run = load_run(_write_replay_run(tmp_path / "tampered", model_path, real_outputs, tamper=True))
    [result] = replay_run(run, llm, request_ids=["cmpl-greedy"])
    expected = run.request("cmpl-greedy").completions[0].token_ids[2]
    real = real_outputs[0][2][0][2]
    assert not result.matched and result.first_divergence == Divergence(0, 2, expected, real)
    assert result.describe() == f"cmpl-greedy MISMATCH at completion 0 position 2: expected {expected}, got {real}"


def test_cli_replay_exits_1_on_a_mismatch(tmp_path, model_path, real_outputs, capsys):
    folder = _write_replay_run(tmp_path / "tampered", model_path, real_outputs, tamper=True)
    manifest = json.loads((folder / schema.MANIFEST_FILE).read_text())
    manifest["model"] = str(tmp_path / "moved-away")  # --model overrides it
    (folder / schema.MANIFEST_FILE).write_text(json.dumps(manifest))
    assert main(["trace", "replay", str(folder), "--model", str(model_path)]) == 1
    out = capsys.readouterr().out
    assert "cmpl-greedy MISMATCH at completion 0 position 2" in out and "cmpl-seeded match" in out
    assert "4 requests: 1 match, 1 mismatch, 2 skipped" in out
    assert main(["trace", "replay", str(folder), "--model", str(model_path), "--request-id", "cmpl-seeded"]) == 0
    assert sorted(p.name for p in folder.iterdir()) == [schema.MANIFEST_FILE, schema.OFFLINE_TRACE_FILE]


def _light_run(tmp_path):
    """One request: a 6-token prefill, then 1-token decodes, 2 of 1024 blocks, under a 2048-token budget."""
    steps = [SyntheticStep(0, i, 5.0 + 5 * i, 9.0 + 5 * i, ["chatcmpl-a"], [6 if i == 0 else 1], int(i == 0),
                           6 if i == 0 else 0, kv_blocks_used=1 + i // 2, kv_blocks_total=1024, token_budget=2048)
             for i in range(4)]
    return load_run(write_run(tmp_path / "light", DEMO_REQUESTS[:1], steps))


def _legend_clear_of_axes(figure, ax) -> bool:
    figure.canvas.draw()  # lay the figure out: legend and axes get their final boxes
    legend = ax.get_legend().get_window_extent()
    return not legend.overlaps(ax.get_window_extent())


def test_a_light_run_fills_the_batch_plot_and_names_the_budget_above_it(tmp_path):
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    figure = plots.plot_batch_composition(_light_run(tmp_path))
    FigureCanvasAgg(figure)
    ax = figure.axes[0]
    assert ax.get_ylim()[1] < 10  # 1-token decodes and a 6-token prefill are visible, not squashed under 2048
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert "token budget: 2048 (above the axis)" in labels
    assert _legend_clear_of_axes(figure, ax)


def test_a_light_run_fills_the_kv_plot_and_names_the_pool_above_it(tmp_path):
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    figure = plots.plot_kv_usage(_light_run(tmp_path))
    FigureCanvasAgg(figure)
    ax = figure.axes[0]
    assert ax.get_ylim()[1] < 5
    assert "engine 0 pool: 1024 (above the axis)" in [t.get_text() for t in ax.get_legend().get_texts()]
    assert _legend_clear_of_axes(figure, ax)


def test_a_pool_near_the_data_is_drawn_as_a_line(run):
    ax = plots.plot_kv_usage(run).axes[0]
    assert [t.get_text() for t in ax.get_legend().get_texts()].count("engine 0 pool: 8") == 1
    assert ax.get_ylim()[1] >= 8
