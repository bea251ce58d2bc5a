"""The walkthrough notebooks, the recorded runs they load, and the extra plots they draw.

Every notebook in notebooks/ runs top to bottom in a fresh kernel of this environment's
python, on the CPU, in under 3 minutes, and shows figures; it runs in memory with
scripts/build_notebooks.py's own `execute`, so the committed file (saved with its
outputs, to render on GitHub) is never rewritten. The recorded runs in traces/ load, are
small, and every request in them can be replayed; scripts/record_traces.py still records
a loadable run from a real server. plots_extra and plots_compare are checked on the synthetic runs of
tests/synthetic_trace.py, whose span times are round milliseconds known by hand.
"""

import dataclasses
import importlib.util
import json
import sys
from pathlib import Path

import nbformat
import pytest
from matplotlib.collections import PolyCollection
from matplotlib.figure import Figure

from tests.synthetic_trace import DEMO_REQUESTS, DEMO_STEPS, SyntheticSequence, write_demo_run, write_run
from tinyserve.trace_reading import load_run, plots_compare, plots_extra
from tinyserve.trace_reading.replay import why_not_reproducible

ROOT = Path(__file__).resolve().parents[1]
MAX_RUN_BYTES = 2_000_000
MS = 1e-3


def load_script(name: str):
    """A module of scripts/ (not a package): the code that builds the notebooks and records the runs."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the class is created
    spec.loader.exec_module(module)
    return module


build_notebooks = load_script("build_notebooks")
record_traces = load_script("record_traces")
measure_spec_sweep = load_script("measure_spec_sweep")
NOTEBOOKS = build_notebooks.notebooks()
RECORDED = sorted(ROOT.glob("traces/recorded-*"))


# ---- the notebooks ------------------------------------------------------------------------------


def test_there_are_eight_notebooks_in_reading_order():
    assert [p.stem[:2] for p in NOTEBOOKS] == ["01", "02", "03", "04", "05", "06", "07", "08"]


@pytest.mark.notebook
def test_notebook_kernel_is_this_environments_python(tmp_path):
    probe = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("import sys; print(sys.prefix)")])
    nbformat.write(probe, tmp_path / "probe.ipynb")
    executed, _ = build_notebooks.execute(tmp_path / "probe.ipynb")
    assert executed.cells[0].outputs[0].text.strip() == sys.prefix


@pytest.mark.notebook
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_top_to_bottom_and_shows_figures(path):
    committed = path.read_bytes()
    executed, seconds = build_notebooks.execute(path)  # raises on the first cell that fails
    assert seconds < build_notebooks.TIMEOUT_S
    assert build_notebooks.image_outputs(executed) >= 1
    errors = [o for c in executed.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors
    assert path.read_bytes() == committed
    if path.stem.startswith("01_"):  # the replay printed both token lists, and they were equal
        printed = "".join(o.get("text", "") for c in executed.cells if c.cell_type == "code" for o in c.outputs)
        assert "same tokens: True" in printed and "MISMATCH" not in printed


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_committed_notebook_is_saved_with_its_outputs(path):
    notebook = nbformat.read(path, as_version=4)
    assert notebook.cells[0].cell_type == "markdown"
    code = [c for c in notebook.cells if c.cell_type == "code"]
    assert code[0].source.startswith("RECORD_FRESH = False")
    assert all(c.execution_count is not None for c in code)
    assert build_notebooks.image_outputs(notebook) >= 1
    # figures are displayed by the inline backend, never silenced by a non-interactive one
    assert not any("matplotlib.use(" in c.source for c in code)


# ---- the recorded runs ---------------------------------------------------------------------------


def test_every_recording_the_notebooks_load_is_committed():
    assert [p.name for p in RECORDED] == sorted(f"recorded-{name}" for name in record_traces.RECORDINGS)


@pytest.mark.parametrize("folder", RECORDED, ids=lambda p: p.name)
def test_recorded_run_is_small_and_every_request_replayable(folder):
    assert sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) < MAX_RUN_BYTES
    recording = json.loads((folder / record_traces.RECORDING_FILE).read_text())
    assert "tinyserve serve --trace" in recording["command"] and len(recording["model_fingerprint"]) == 64
    # the workload the script would send today is the one recorded (notebook 2 reuses its prompts)
    recipe = record_traces.RECORDINGS[folder.name.removeprefix("recorded-")]
    assert recording["workload"] == [record_traces.as_logged(r) for r in recipe.workload]
    assert recording["single_chat"] == recipe.single_chat
    run = load_run(folder)
    # one request per prompt (an embedding request of several inputs is one per input)
    expected = 1 if recording["single_chat"] else sum(
        len(r["body"]["input"]) if isinstance(r["body"].get("input"), list) else 1 for r in recording["workload"])
    assert len(run.requests) == expected  # the warm-up request was taken out, nothing else
    assert run.steps and all(s.kv_blocks_total for s in run.steps)
    left = [r for r in run.requests if r.error == "aborted"]  # the clients the recipe has leave
    assert len(left) == sum(1 for r in recipe.workload if r.disconnect_after is not None)
    # the requests a killed node held fail, naming it; those of the head's engine do not
    lost = [r for r in run.requests if r.error and "engine 1 (on a headless node) died" in r.error]
    assert bool(lost) == (recipe.kill_node_at_s is not None)
    for request in run.requests:
        assert request.inputs.prompt != "Warm up."
        if request in lost:
            assert not request.sequences or request.sequences[0].engine_index != 0
            continue
        assert request.error == ("aborted" if request in left else None) and request.ttft_s > 0
        # every request can be replayed: an aborted one up to where it stopped, a pooled one by its vector's length
        assert why_not_reproducible(request, run) is None
    assert all(why_not_reproducible(request, run) is None for request in lost)


def test_the_speculation_sweep_chapter_6_reads_is_the_scripts_workload_on_the_built_in_model():
    sweep = json.loads(measure_spec_sweep.SWEEP_FILE.read_text())
    assert sweep["workload"] == {
        "concurrencies": list(measure_spec_sweep.CONCURRENCIES), "rounds": measure_spec_sweep.ROUNDS,
        "max_tokens": measure_spec_sweep.MAX_TOKENS, "speculative_config": record_traces.SPECULATIVE_CONFIG,
        "model_fingerprint": record_traces.model_fingerprint()}
    engines = ("plain", "speculative")
    assert [(r["concurrency"], r["engine"]) for r in sweep["rows"]] == \
        [(c, name) for c in measure_spec_sweep.CONCURRENCIES for name in engines]
    assert all(r["tokens"] == r["concurrency"] * measure_spec_sweep.MAX_TOKENS for r in sweep["rows"])
    assert 0 < sweep["drafts"]["accepted"] <= sweep["drafts"]["proposed"]


# Replaying every shipped run, token for token, on an engine configured as its manifest says: tests/test_replay_runs.py.


@pytest.mark.server
def test_record_traces_records_a_run_from_a_real_server(tmp_path):
    folder = record_traces.record("lifecycle", tmp_path)
    assert folder == tmp_path / "recorded-lifecycle"
    files = sorted(p.name for p in folder.iterdir())
    assert files == ["api.jsonl", "engine-0.jsonl", "manifest.json", "recording.json"]
    run = load_run(folder)
    [request] = run.requests  # the warm-up request is gone, with the steps that served only it
    assert request.operation == "chat" and request.inputs.sampling_params["seed"] == 1234
    assert {s.service for s in request.stage_spans()} == {"tinyserve-api", "tinyserve-engine-0"}
    engine_id = request.sequences[0].request_id
    # every step left served it, but the last, which only releases its blocks (the engine then idles)
    assert run.steps and all(engine_id in step.request_ids for step in run.steps[:-1])
    assert run.steps[-1].request_ids == [] and run.steps[-1].released_request_ids == [engine_id]
    recording = json.loads((folder / "recording.json").read_text())
    assert recording["model_fingerprint"] == record_traces.model_fingerprint()


# ---- plots_extra and plots_compare --------------------------------------------------------------


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    return load_run(write_demo_run(tmp_path_factory.mktemp("runs") / "demo"))


def in_ms(parts: dict[str, float]) -> list[float]:
    return [round(seconds / MS, 6) for seconds in parts.values()]


def test_ttft_breakdown_cuts_ttft_at_the_span_edges(demo):
    # chatcmpl-a: render 0→1, enqueue 1→1.5, ipc.send 1.5→1.6, queue 3→5, first token 15 (ms)
    request = demo.request("chatcmpl-a")
    parts = plots_extra.ttft_breakdown(request)
    assert list(parts) == list(plots_extra.TTFT_SEGMENTS)
    assert in_ms(parts) == [0.0, 1.0, 0.5, 0.1, 1.4, 2.0, 10.0]
    assert sum(parts.values()) == pytest.approx(request.ttft_s)


def test_ttft_breakdown_follows_the_completion_with_the_first_token(demo):
    # cmpl-b, n=2: completion 0 (queue 13→14, first token 20) answers first
    assert in_ms(plots_extra.ttft_breakdown(demo.request("cmpl-b"))) == [0.0, 1.0, 0.5, 0.1, 1.4, 1.0, 6.0]


def test_ttft_breakdown_gives_an_overlap_to_the_later_stage(tmp_path):
    # the engine takes the request in at 1.55 ms, before ipc.send (1.5 → 1.6) has ended
    early = SyntheticSequence("chatcmpl-a", 0, 1.55, 5.0, [15.0, 25.0, 35.0, 45.0])
    run = load_run(write_run(tmp_path / "overlap", [dataclasses.replace(DEMO_REQUESTS[0], sequences=[early])], []))
    assert in_ms(plots_extra.ttft_breakdown(run.requests[0])) == [0.0, 1.0, 0.5, 0.05, 0.0, 3.45, 10.0]


def test_ttft_breakdown_offline_has_no_ipc(tmp_path):
    run = load_run(write_run(tmp_path / "offline", DEMO_REQUESTS[:1], DEMO_STEPS[:2], offline=True))
    # enqueue runs from the end of render (1 ms) to the engine's queue (3 ms)
    assert in_ms(plots_extra.ttft_breakdown(run.requests[0])) == [0.0, 1.0, 2.0, 0.0, 0.0, 2.0, 10.0]


FIGURES = {
    "ttft_breakdown": lambda run: plots_extra.plot_ttft_breakdown(run),
    "step_occupancy": lambda run: plots_extra.plot_step_occupancy(run),
    "step_occupancy_zoomed": lambda run: plots_extra.plot_step_occupancy(run, engine_index=1, step_range=(1, 1)),
    "kv_pressure": lambda run: plots_extra.plot_kv_pressure(run, engine_index=1),
    "prefix_cache_hits": lambda run: plots_extra.plot_prefix_cache_hits(run),
    "engine_balance": lambda run: plots_extra.plot_engine_balance(run),
    "latency_by_run": lambda run: plots_compare.plot_latency_by_run({"a": run, "b": run}, ("ttft", "tpot", "itl", "e2e")),
    "stage_comparison": lambda run: plots_compare.plot_stage_comparison({"a": run, "b": run}),
    "completion_cdf_time": lambda run: plots_compare.plot_completion_cdf({"a": run}, clock="time"),
    "completion_cdf_steps": lambda run: plots_compare.plot_completion_cdf({"a": run}, clock="steps"),
    "run_comparison_time": lambda run: plots_compare.plot_run_comparison({"a": run, "b": run}, clock="time"),
    "run_comparison_steps": lambda run: plots_compare.plot_run_comparison({"a": run, "b": run}, clock="steps"),
    "block_tables": lambda run: plots_extra.plot_block_tables(
        [{"r1": [0, 1]}, {"r1": [0, 1, 4], "r2": [0, 2]}, {"r2": [0, 2, 3]}], num_blocks=6,
        step_ids=[7, 8, 9], cached_free_blocks=[set(), set(), {1, 4}]),
}


@pytest.mark.parametrize("name", FIGURES)
def test_plots_extra_return_labelled_figures(demo, name):
    figure = FIGURES[name](demo)
    assert isinstance(figure, Figure)
    main_axes = [ax for ax in figure.axes if ax.get_xlabel()]  # twin axes share their host's x label
    assert main_axes
    for ax in main_axes:
        assert ax.get_ylabel() and ax.get_title()
    assert any(ax.get_legend() for ax in figure.axes) or figure.legends or name.startswith("run_comparison")


def test_step_occupancy_draws_one_cell_per_request_and_step(demo):
    ax = plots_extra.plot_step_occupancy(demo, engine_index=0).axes[0]
    cells = [c for c in ax.collections if isinstance(c, PolyCollection)]
    assert len(cells) == sum(len(s.request_ids) for s in DEMO_STEPS if s.engine_index == 0)
    assert [t.get_text() for t in ax.get_yticklabels()] == ["chatcmpl-a", "chatcmpl-c"]


def test_completion_cdf_in_steps_counts_the_steps_started_by_then(demo):
    ax = plots_compare.plot_completion_cdf({"demo": demo}, clock="steps").axes[0]
    finished = next(line for line in ax.get_lines() if line.get_label() == "demo: finished")
    # the requests end at 50, 60 and 70 ms, after all five steps (the last starts at 36 ms) had started
    assert list(finished.get_xdata()) == [0, 5, 5, 5]


def test_run_comparison_in_steps_counts_ttft_and_the_largest_decode_step(demo):
    axes = plots_compare.plot_run_comparison({"demo": demo}, clock="steps").axes
    heights = [[bar.get_height() for bar in ax.patches] for ax in axes]
    # steps: 5; tokens per step: (6+4+6+5+6)/5; TTFT in steps: a 2 (5, 10 ms), b 2 (14, 20 ms), c 1 (36 ms);
    # the largest step with a decode: 6 tokens (engine 0 step 2, engine 1 step 1)
    assert heights == [[5], [pytest.approx(27 / 5)], [pytest.approx(5 / 3)], [6]]


def test_bad_plot_arguments_are_value_errors_naming_the_parameter(demo):
    with pytest.raises(ValueError, match="metrics"):
        plots_compare.plot_latency_by_run({"a": demo}, metrics=("p99",))
    with pytest.raises(ValueError, match="clock"):
        plots_compare.plot_completion_cdf({"a": demo}, clock="tokens")
    with pytest.raises(ValueError, match="clock"):
        plots_compare.plot_run_comparison({"a": demo}, clock="tokens")
