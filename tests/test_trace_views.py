"""`tinyserve trace request` and `trace step`: one request, or one step, of every shipped run on the command line.

Each quiz-like question a reader asks of a run ("how long did this request wait, which
steps served it, what was its block table at step N, when was it preempted, what did step N
run") is one command; the answers are checked against the run's spans read another way.
"""

import json
from pathlib import Path

import pytest

from tests.server_checks import sse_lines
from tinyserve.cli.main import main
from tinyserve.lifecycle import schema
from tinyserve.trace_reading.run import load_run
from tinyserve.trace_reading.ttft import TTFT_PIECES
from tinyserve.trace_reading.views import request_view, step_view

TRACES = Path(__file__).resolve().parents[1] / "traces"
RUNS = sorted(TRACES.glob("recorded-*"))


def cli_json(capsys, *argv) -> dict:
    assert main(["trace", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_every_shipped_run_is_there():
    assert len(RUNS) >= 12


@pytest.mark.parametrize("folder", RUNS, ids=lambda p: p.name)
def test_both_views_work_on_every_request_and_step_of_every_shipped_run(folder, capsys):
    run = load_run(folder)
    for timeline in run.requests:
        view = request_view(run, timeline.request_id)
        json.dumps(view)
        served = {(s.engine_index, s.step_id) for s in run.steps
                  for sequence in timeline.sequences if sequence.request_id in s.request_ids}
        listed = {(sequence["engine_index"], row["step_id"]) for sequence in view["sequences"]
                  for row in sequence["steps"] if row["kind"] != "preempted"}
        assert listed == served  # which steps served it: every one, and no other
        breakdown = view["ttft_breakdown_ms"]
        if timeline.ttft_s is None:  # no token ever came (its node died with it)
            assert breakdown == {} and timeline.error
            continue
        assert breakdown["ttft"] == pytest.approx(timeline.ttft_s * 1e3, abs=1e-3)
        # chapter 1's pieces, a partition of arrival → first token: none negative, adding up to TTFT
        assert list(breakdown) == [*TTFT_PIECES, "ttft"] and min(breakdown.values()) >= 0
        assert sum(v for k, v in breakdown.items() if k != "ttft") == pytest.approx(breakdown["ttft"], abs=0.01)
    for step in run.steps:
        view = step_view(run, step.step_id, step.engine_index)
        # the view's own reading of each request's work agrees with the engine's counts of the step
        assert sum(r["tokens"] for r in view["batch"] if r["kind"] in ("prefill", "recompute")) == \
            step.num_prefill_tokens
        assert sum(r["tokens"] for r in view["batch"] if r["kind"] == "decode") == step.num_decode_tokens
        assert view["kv_blocks"]["allocated"] == sum(len(ids) for ids in step.new_block_ids)
    first = run.requests[0].request_id
    assert main(["trace", "request", str(folder), first]) == 0
    text = capsys.readouterr().out
    assert first in text and "steps that served it" in text and "logged inputs" in text
    step = run.steps[len(run.steps) // 2]
    argv = ["trace", "step", str(folder), str(step.step_id), "--engine", str(step.engine_index)]
    assert main(argv) == 0
    assert f"step {step.step_id} of engine {step.engine_index}" in capsys.readouterr().out


def test_how_long_it_waited_which_steps_served_it_and_its_block_table_are_one_command(capsys):
    folder = Path(__file__).resolve().parents[1] / "traces" / "recorded-lifecycle"
    run = load_run(folder)
    [timeline] = run.requests
    view = cli_json(capsys, "request", str(folder), timeline.request_id)
    [sequence] = view["sequences"]
    queue = next(s for s in run.spans if s.name == schema.QUEUE and s.trace_id == timeline.trace_id)
    assert sequence["stages_ms"]["queue"] == pytest.approx(queue.duration_s * 1e3, abs=1e-3)
    kinds = [row["kind"] for row in sequence["steps"]]
    assert kinds[0] == "prefill" and set(kinds[1:]) == {"decode"}
    assert len(kinds) == timeline.num_output_tokens  # one prefill that sampled, then one decode per token
    growth = sequence["block_table_growth"]
    for row in sequence["steps"]:  # the table at any step: the last growth at or before it
        table = [g["block_ids"] for g in growth if g["step_id"] <= row["step_id"]][-1]
        assert table == run.block_table(sequence["request_id"], row["step_id"])
    assert view["inputs"]["sampling_params"]["seed"] == 1234 and view["inputs"]["messages"]
    span_names = [row["name"] for row in view["span_tree"]]
    assert span_names.index(schema.RENDER) < span_names.index(schema.QUEUE) < span_names.index(schema.DECODE)
    assert {row["service"] for row in view["span_tree"]} == {schema.SERVICE_API, schema.engine_service_name(0)}


def test_when_a_request_was_preempted_and_recomputed_and_what_the_preemption_freed(capsys):
    folder = Path(__file__).resolve().parents[1] / "traces" / "recorded-kv-tight"
    run = load_run(folder)
    victim = next(t for t in run.requests if t.sequences[0].num_preemptions)
    view = cli_json(capsys, "request", str(folder), victim.request_id)
    rows = view["sequences"][0]["steps"]
    preempted_at = [row["step_id"] for row in rows if row["kind"] == "preempted"]
    assert preempted_at == [s.step_id for s in run.steps if victim.request_id in s.preempted_request_ids]
    after = [row for row in rows if row["step_id"] > preempted_at[0]]
    assert after[0]["kind"] == "recompute" and after[0]["tokens"] > 1  # its prompt and tokens computed again
    step = cli_json(capsys, "step", str(folder), str(preempted_at[0]))
    assert victim.request_id in step["preempted_request_ids"]
    assert step["kv_blocks"]["freed_by_preemption"][victim.request_id] == \
        run.block_table(victim.request_id, preempted_at[0] - 1)


def test_a_step_of_a_run_with_several_engines_needs_its_engine_and_unknown_ids_name_what_exists(capsys):
    folder = Path(__file__).resolve().parents[1] / "traces" / "recorded-load-dp2"
    assert main(["trace", "step", str(folder), "3"]) == 1
    assert "say which with --engine" in capsys.readouterr().err
    assert main(["trace", "step", str(folder), "99999", "--engine", "1"]) == 1
    assert "has no step 99999 (its steps: " in capsys.readouterr().err
    assert main(["trace", "request", str(folder), "chatcmpl-nope"]) == 1
    assert "is not in run recorded-load-dp2 (it has 24 requests" in capsys.readouterr().err
    view = cli_json(capsys, "step", str(folder), "3", "--engine", "1")
    assert view["engine_index"] == 1


def test_a_tensor_parallel_step_shows_each_rank(capsys):
    folder = Path(__file__).resolve().parents[1] / "traces" / "recorded-load-tp2"
    run = load_run(folder)
    step = next(s for s in run.steps if s.num_requests)
    view = cli_json(capsys, "step", str(folder), str(step.step_id))
    assert [r["rank"] for r in view["tensor_parallel_ranks"]] == [0, 1]


# ---- the layers, each on its shipped run ----------------------------------------------------------


def test_a_pipeline_step_shows_each_stage_its_wait_for_its_input_and_its_compute(capsys):
    folder = TRACES / "recorded-pp2"
    run = load_run(folder)
    step = next(s for s in run.steps if s.num_requests >= 2)
    executes = sorted((c for c in run.spans if c.name == schema.EXECUTE and c.parent_span_id == step.span.span_id),
                      key=lambda c: c.attributes[schema.PP_STAGE])
    view = cli_json(capsys, "step", str(folder), str(step.step_id))
    stages = view["pipeline_stages"]
    assert [s["stage"] for s in stages] == [c.attributes[schema.PP_STAGE] for c in executes] == [0, 1]
    assert view["tensor_parallel_ranks"] == []  # one rank per stage: no tensor parallelism to show
    for stage, execute in zip(stages, executes):
        wait = execute.attributes[schema.PP_RECV_WAIT_TIME]
        assert stage["recv_wait_ms"] == pytest.approx(wait * 1e3, abs=1e-3)
        assert stage["compute_ms"] == pytest.approx((execute.duration_s - wait) * 1e3, abs=2e-3)
        assert stage["start_ms"] == pytest.approx((execute.start_ns - step.start_ns) / 1e6, abs=1e-3)
    assert main(["trace", "step", str(folder), str(step.step_id)]) == 0
    text = capsys.readouterr().out
    assert "pipeline stage 0 (rank 0" in text and "pipeline stage 1 (rank 0" in text
    assert f"waited {stages[1]['recv_wait_ms']:.2f} for its input" in text and "tensor-parallel rank" not in text


def test_speculative_steps_show_drafts_accepted_and_tokens_emitted_not_positions_as_tokens(capsys):
    folder = TRACES / "recorded-spec-decode"
    run = load_run(folder)
    for timeline in run.requests:
        [sequence] = timeline.sequences
        view = request_view(run, timeline.request_id)
        rows = view["sequences"][0]["steps"]
        assert sum(row.get("emitted", row["sampled"]) for row in rows) == sequence.num_output_tokens
        for row in rows:
            if "drafted" not in row:
                continue
            step = next(s for s in run.steps if s.step_id == row["step_id"])
            attributes = step.span.attributes
            i = list(attributes[schema.STEP_SPEC_REQUEST_IDS]).index(sequence.request_id)
            assert (row["drafted"], row["accepted"]) == (attributes[schema.STEP_SPEC_NUM_PROPOSED][i],
                                                         attributes[schema.STEP_SPEC_NUM_ACCEPTED][i])
            assert row["tokens"] == 1 + row["drafted"]  # positions computed: the newest token and its drafts
            emitted = sum(1 for t in sequence.token_times_ns if step.start_ns <= t <= step.end_ns)
            assert row["emitted"] == emitted <= row["accepted"] + 1  # a stop can end it before them all
            # shipped before steps recorded rollback frees: said, not guessed
            assert row["rollback_freed_block_ids"] == "not recorded in this run"
        assert "not recorded in this run" in view["sequences"][0]["block_table_note"]
    stopped = [(t, row) for t in run.requests for row in request_view(run, t.request_id)["sequences"][0]["steps"]
               if "drafted" in row and row["emitted"] < row["accepted"] + 1]
    assert stopped  # the run has a request that stopped inside its accepted drafts (chapter 6's step 12)
    timeline, row = stopped[0]
    assert main(["trace", "request", str(folder), timeline.request_id]) == 0
    text = capsys.readouterr().out
    assert (f"step {row['step_id']:>5}  decode        4 positions (newest token + {row['drafted']} drafts): "
            f"{row['accepted']} accepted, {row['emitted']} token(s) out") in text


def test_a_speculative_step_that_ran_nothing_shows_no_propose_or_verify_time(capsys):
    folder = TRACES / "recorded-spec-decode"
    run = load_run(folder)
    steps = sorted(run.steps, key=lambda s: s.step_id)
    empty = next(s for s in steps if not s.request_ids)  # it only released a finished request's blocks
    before = next(s for s in reversed(steps) if s.step_id < empty.step_id)
    view = cli_json(capsys, "step", str(folder), str(empty.step_id))
    assert view["speculative"]["verify_ms"] is None and view["speculative"]["propose_ms"] is None
    busy = cli_json(capsys, "step", str(folder), str(before.step_id))
    assert busy["speculative"]["verify_ms"] == pytest.approx(
        before.span.attributes[schema.STEP_SPEC_VERIFY_TIME] * 1e3, abs=1e-3)
    assert busy["speculative"]["drafted"] == sum(p for p, _ in before.drafts.values())
    assert busy["batch"][0]["emitted"] >= 1
    assert main(["trace", "step", str(folder), str(empty.step_id)]) == 0
    assert "no forward pass, so no verify or propose time" in capsys.readouterr().out
    assert main(["trace", "step", str(folder), str(before.step_id)]) == 0
    text = capsys.readouterr().out
    assert "decode positions" in text and "drafts verified" in text and "not recorded in this run" in text


def test_each_request_of_a_lora_run_shows_its_adapter(capsys):
    folder = TRACES / "recorded-lora"
    run = load_run(folder)
    names = set()
    for timeline in run.requests:
        logged = timeline.request_span.attributes.get(schema.LORA_NAME)
        view = request_view(run, timeline.request_id)
        assert view["adapter"] == (logged if logged is not None else "base model")
        names.add(view["adapter"])
    assert len(names) >= 3  # the base model and at least two adapters
    step = max(run.steps, key=lambda s: s.num_requests)
    view = cli_json(capsys, "step", str(folder), str(step.step_id))
    for row in view["batch"]:
        logged = run.request(row["request_id"]).request_span.attributes.get(schema.LORA_NAME)
        assert row["adapter"] == (logged if logged is not None else "base model")
    assert {row["adapter"] for row in view["batch"]} - {"base model"} == \
        set(step.span.attributes[schema.STEP_LORA_ADAPTERS])  # the step's own list of its batch's adapters
    sql = next(t for t in run.requests if t.request_span.attributes.get(schema.LORA_NAME) == "sql")
    assert main(["trace", "request", str(folder), sql.request_id]) == 0
    assert ", adapter sql," in capsys.readouterr().out


def test_kv_that_reached_the_decode_server_by_transfer_is_not_called_the_prefix_caches(capsys):
    folder = TRACES / "recorded-pd-disaggregated"  # the decode server; the prefill server's run is in prefill/
    run = load_run(folder)
    received_somewhere = False
    for timeline in run.requests:
        [sequence] = timeline.sequences
        received = sequence.prefill.attributes.get(schema.KV_TRANSFER_NUM_RECEIVED_TOKENS)
        [row] = request_view(run, timeline.request_id)["sequences"]
        assert row["num_received_tokens"] == received
        assert row["num_prefix_cache_tokens"] == sequence.num_cached_tokens - (received or 0)
        transfers = [s for s in run.spans if s.name == schema.KV_TRANSFER and s.trace_id == timeline.trace_id]
        assert [t["role"] for t in row["kv_transfers"]] == [t.attributes[schema.KV_TRANSFER_ROLE] for t in transfers]
        received_somewhere |= bool(received)
    assert received_somewhere
    timeline = next(t for t in run.requests if t.sequences[0].prefill.attributes.get(
        schema.KV_TRANSFER_NUM_RECEIVED_TOKENS))
    sequence = timeline.sequences[0]
    received = sequence.prefill.attributes[schema.KV_TRANSFER_NUM_RECEIVED_TOKENS]
    assert main(["trace", "request", str(folder), timeline.request_id]) == 0
    text = capsys.readouterr().out
    assert (f"{sequence.num_cached_tokens - received} prompt tokens from the prefix cache, {received} whose K/V "
            "arrived by transfer from the prefill server") in text
    assert "KV transfer, received" in text
    first = min(s.step_id for s in run.steps if sequence.request_id in s.request_ids)
    step = cli_json(capsys, "step", str(folder), str(first))
    [row] = [r for r in step["batch"] if r["request_id"] == sequence.request_id]
    assert row["received_tokens"] == received
    # the prefill server's side of the same request sent it
    prefill_run = load_run(folder / "prefill")
    sent = [s for s in prefill_run.spans if s.name == schema.KV_TRANSFER]
    assert sent and {s.attributes[schema.KV_TRANSFER_ROLE] for s in sent} == {"producer"}
    producer = next(t for t in prefill_run.requests if t.trace_id == sent[0].trace_id)
    [row] = request_view(prefill_run, producer.request_id)["sequences"]
    assert row["kv_transfers"][0]["role"] == "producer" and row["num_received_tokens"] is None


def test_a_request_of_n_2_shows_its_two_children_each_with_its_own_seed(tmp_path, capsys, monkeypatch):
    from tests.tiny_checkpoints import tiny_model_with_tokenizer
    from tinyserve import LLM, SamplingParams

    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "host.name=learner-box")  # OpenTelemetry's way to name a host
    from tinyserve.lifecycle.tracing import shutdown_tracing

    try:
        llm = LLM(str(tiny_model_with_tokenizer("llama")), num_kv_blocks=32, trace_dir=str(tmp_path))
        [output] = llm.generate("flat is better", SamplingParams(n=2, temperature=0.8, seed=41, max_tokens=4),
                                use_tqdm=False)
    finally:
        shutdown_tracing()  # this process's tracer goes: later tests start untraced
    [folder] = [p for p in tmp_path.iterdir() if p.is_dir()]
    view = cli_json(capsys, "request", str(folder), output.request_id)
    children = view["sequences"]
    assert [c["request_id"] for c in children] == [f"{i}_{output.request_id}" for i in range(2)]
    assert [c["seed"] for c in children] == [41, 42]  # the parent's seed + the child's index
    assert [c["token_ids"] for c in view["completions"]] == [list(c.token_ids) for c in output.outputs]
    assert {row["host"] for row in view["span_tree"]} == {"learner-box"}
    assert main(["trace", "request", str(folder), f"1_{output.request_id}"]) == 0
    text = capsys.readouterr().out
    assert "seed 42" in text and "tinyserve-offline@learner-box" in text


def test_the_block_map_gives_every_request_its_own_colour_past_the_palette():
    from matplotlib.colors import to_hex

    from tinyserve.trace_reading.plots import PALETTE
    from tinyserve.trace_reading.plots_blocks import plot_block_map, request_colors

    for count in (3, len(PALETTE) + 1, 40):
        colors = {to_hex(c) for c in request_colors(count)}
        assert len(colors) == count and not colors & {to_hex("white"), to_hex("tab:gray")}
    run = load_run(Path(__file__).resolve().parents[1] / "traces" / "recorded-mixed")
    figure = plot_block_map(run)
    [image] = figure.axes[0].get_images()
    drawn = {to_hex(c) for c in image.cmap.colors[2:]}
    assert len(drawn) == len({r for tables in run.block_tables(0).values() for r in tables}) > len(PALETTE)


def test_the_tensor_parallel_plot_says_when_it_shows_only_some_steps():
    from tinyserve.trace_reading.plots_scale_out import plot_tensor_parallel_steps

    run = load_run(Path(__file__).resolve().parents[1] / "traces" / "recorded-load-tp2")
    total = sum(1 for s in run.steps if s.ranks)
    assert f"the first 60 of {total} steps" in plot_tensor_parallel_steps(run).axes[0].get_title()
    assert f"all {total} steps" in plot_tensor_parallel_steps(run, max_steps=total).axes[0].get_title()


@pytest.mark.server
def test_a_client_that_leaves_mid_stream_has_its_blocks_released_on_a_step_and_orca_reports_are_kept(
        tmp_path, capsys):
    import signal

    import httpx

    from tests.server_checks import metric, wait_until
    from tests.tiny_checkpoints import tiny_model_with_tokenizer
    from tinyserve.testing import ServerProcess

    server = ServerProcess(str(tiny_model_with_tokenizer("llama")), "--served-model-name", "tiny", "--trace",
                           "--trace-dir", str(tmp_path), "--num-kv-blocks", "64")
    try:
        asked = httpx.post(f"{server.url}/v1/completions", timeout=60, headers={"endpoint-load-metrics-format": "json"},
                           json={"model": "tiny", "prompt": "load?", "max_tokens": 2})
        told = asked.headers["endpoint-load-metrics"]
        body = {"model": "tiny", "prompt": "a long answer", "max_tokens": 400, "stream": True}
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as response:
            chunks = sse_lines(response)
            first = json.loads(next(line for line in chunks if line.startswith("data: "))[6:])
            for _ in range(3):
                next(chunks)
        # the client has gone; the engine aborts the request and, with nothing else to run, goes idle
        wait_until(lambda: metric(server.url, "num_requests_running") == 0, 30, "the request was aborted")
    finally:
        server.stop(signal.SIGINT)
    [folder] = [p for p in tmp_path.iterdir() if p.is_dir()]
    run = load_run(folder)
    [sequence] = run.request(first["id"]).sequences
    [release] = [s for s in run.steps if sequence.request_id in s.released_request_ids]
    assert release is run.steps[-1] and release.request_ids == []  # an empty step, the last the engine ran
    step = cli_json(capsys, "step", str(folder), str(release.step_id))
    held = run.block_table(sequence.request_id, release.step_id - 1)
    assert held and step["kv_blocks"]["released"] == {sequence.request_id: held}
    assert step["kv_blocks"]["used"] == 0
    # the ORCA report a load balancer was given is on that request's HTTP span
    assert run.request(asked.json()["id"]).http_span.attributes[schema.HTTP_RESPONSE_ORCA_REPORT] == [told]


def test_the_recorded_cases_show_what_chapter_one_says_they_do():
    run = load_run(Path(__file__).resolve().parents[1] / "traces" / "recorded-cases")
    fanned, left, constrained, reported = run.requests
    assert [s.seed for s in fanned.sequences] == [7, 8] and len(fanned.completions) == 2
    assert left.finish_reasons == ["abort"]
    [release] = [s for s in run.steps if left.sequences[0].request_id in s.released_request_ids]
    assert release.request_ids == []  # it ran alone: the release is on a step of its own
    assert any(s.name == schema.STRUCTURED_OUTPUT and s.trace_id == constrained.trace_id for s in run.spans)
    masked = {s.step_id for s in run.steps if s.span.attributes.get(schema.STEP_GRAMMAR_BITMASK_TIME)}
    assert masked and masked <= {s.step_id for s in run.steps if constrained.sequences[0].request_id in s.request_ids}
    assert json.loads(reported.http_span.attributes[schema.HTTP_RESPONSE_ORCA_REPORT][0].removeprefix("JSON "))


def test_an_image_request_shows_its_images_and_a_step_what_it_encoded(capsys):
    """recorded-multimodal: a request's images (hash, placeholder run) as its render span logged them; a step
    that computed placeholders, the images it encoded and those the encoder cache had, as its span says."""
    folder = TRACES / "recorded-multimodal"
    run = load_run(folder)
    last = run.requests[-1]  # two pictures in one prompt
    view = cli_json(capsys, "request", str(folder), last.request_id)
    images = view["inputs"]["images"]
    assert [i["mm_hash"] for i in images] == last.inputs.mm_hashes and [i["length"] for i in images] == [256, 256]
    ids = last.inputs.prompt_token_ids
    assert all(set(ids[i["offset"]:i["offset"] + i["length"]]) == {ids[images[0]["offset"]]} for i in images)
    encoding = [s for s in run.steps if s.span.attributes.get(schema.STEP_MM_IMAGES_ENCODED)]
    step = cli_json(capsys, "step", str(folder), str(encoding[0].step_id))
    assert step["images"]["encoded"] == encoding[0].span.attributes[schema.STEP_MM_IMAGES_ENCODED] >= 1
    assert cli_json(capsys, "step", str(folder), str(run.steps[-1].step_id))["images"] is None  # no placeholders
    assert main(["trace", "request", str(folder), last.request_id]) == 0
    assert f"image {images[1]['mm_hash'][:12]}: placeholders 260..515 (256 tokens)" in capsys.readouterr().out
