"""`tinyserve trace ...`: read a run folder written with --trace.

    tinyserve trace summarize RUN [--all-requests]                latency, stage, engine and request tables
    tinyserve trace request RUN ID [--json]                       one request: spans, TTFT, steps, blocks, inputs
    tinyserve trace step RUN N [--engine I] [--json]              one engine step: batch, KV blocks, timing
    tinyserve trace export RUN --format jaeger -o run.json        for Jaeger UI (Search → JSON File)
    tinyserve trace export RUN --format perfetto -o run.json      for ui.perfetto.dev
    tinyserve trace plot RUN -o DIR                               waterfall, latency, batch and KV-usage PNGs
    tinyserve trace replay RUN [--request-id ID] [--model PATH]   re-run the logged requests, compare tokens
    tinyserve trace merge HEAD_RUN NODE_RUN... -o OUT             one run from several nodes' folders

RUN is a folder under traces/ (manifest.json plus one .jsonl file per process).
`replay` builds an offline engine from the manifest's model and engine arguments
(--model overrides the model), prints one line per request and a summary, and
exits with 1 if any request produced different tokens. An aborted request is
replayed up to where it stopped; a LoRA request under the run's copy of its adapter
(RUN/adapters/NAME/) when the run holds one.
"""

import argparse
import json
import os
import sys
from pathlib import Path

from tinyserve.trace_reading.export import FORMATS, write_export
from tinyserve.trace_reading.run import Run, load_run

PLOTS = ("request_waterfall", "latency_histograms", "batch_composition", "kv_usage")


def add_parser(commands) -> None:
    parser = commands.add_parser("trace", help="summarize, export, plot or replay a traced run",
                                 description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    actions = parser.add_subparsers(dest="trace_command", required=True, metavar="ACTION")

    summarize_parser = actions.add_parser("summarize", help="print latency, stage and engine tables, and the "
                                                             "requests' ids")
    summarize_parser.add_argument("run", help="the run folder")
    summarize_parser.add_argument("--all-requests", action="store_true",
                                  help="list every request (default: the first 30 by arrival)")
    summarize_parser.set_defaults(handler=summarize)

    request_parser = actions.add_parser("request", help="one request: its spans, TTFT breakdown, steps, block "
                                                         "table, preemptions and logged inputs")
    request_parser.add_argument("run", help="the run folder")
    request_parser.add_argument("request_id", metavar="ID", help="the id the client saw, or an engine request id")
    request_parser.add_argument("--json", action="store_true", help="print JSON instead of text")
    request_parser.set_defaults(handler=show_request)

    step_parser = actions.add_parser("step", help="one engine step: its batch, KV blocks and timing")
    step_parser.add_argument("run", help="the run folder")
    step_parser.add_argument("step_id", metavar="N", type=int, help="the step's id (tinyserve.step.id)")
    step_parser.add_argument("--engine", type=int, default=None,
                             help="the engine index (needed when the run has several engines)")
    step_parser.add_argument("--json", action="store_true", help="print JSON instead of text")
    step_parser.set_defaults(handler=show_step)

    export_parser = actions.add_parser("export", help="write the run for Jaeger or Perfetto")
    export_parser.add_argument("run", help="the run folder")
    export_parser.add_argument("--format", choices=FORMATS, required=True,
                               help="jaeger (JSON upload) or perfetto (trace events)")
    export_parser.add_argument("-o", "--output", required=True, help="the JSON file to write")
    export_parser.set_defaults(handler=export)

    plot_parser = actions.add_parser("plot", help="write PNGs: " + ", ".join(PLOTS))
    plot_parser.add_argument("run", help="the run folder")
    plot_parser.add_argument("-o", "--output-dir", required=True,
                             help="the folder for the PNG files (created if missing)")
    plot_parser.set_defaults(handler=plot)

    replay_parser = actions.add_parser("replay", help="re-run the logged requests and compare their tokens")
    replay_parser.add_argument("run", help="the run folder")
    replay_parser.add_argument("--request-id", action="append", default=None,
                               help="replay only this request (repeatable; default: all)")
    replay_parser.add_argument("--model", default=None, help="the model folder (default: the manifest's model)")
    replay_parser.set_defaults(handler=replay)

    merge_parser = actions.add_parser("merge", help="join the run folders of a head and its headless nodes")
    merge_parser.add_argument("runs", nargs="+", help="the run folders: the head's and each headless node's")
    merge_parser.add_argument("-o", "--output", required=True, help="the merged run folder to create")
    merge_parser.set_defaults(handler=merge)


def _load(path: str) -> Run | None:
    try:
        return load_run(path)
    except (ValueError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return None


def summarize(args: argparse.Namespace) -> int:
    from tinyserve.trace_reading.summary import MAX_REQUESTS_LISTED, summarize as summarize_run

    run = _load(args.run)
    if run is None:
        return 1
    try:
        print(summarize_run(run, max_requests=None if args.all_requests else MAX_REQUESTS_LISTED), flush=True)
    except BrokenPipeError:  # `| head` closed the pipe: fine, and nothing more to say
        # Python's advice: point stdout at devnull, or the flush at exit raises again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


def show_request(args: argparse.Namespace) -> int:
    from tinyserve.trace_reading.views import request_view
    from tinyserve.trace_reading.views_text import format_request

    return _show(args, lambda run: request_view(run, args.request_id), format_request)


def show_step(args: argparse.Namespace) -> int:
    from tinyserve.trace_reading.views import step_view
    from tinyserve.trace_reading.views_text import format_step

    return _show(args, lambda run: step_view(run, args.step_id, args.engine), format_step)


def _show(args: argparse.Namespace, make_view, format_view) -> int:
    run = _load(args.run)
    if run is None:
        return 1
    try:
        view = make_view(run)
    except ValueError as error:  # an id the run does not hold: the message names what it does hold
        print(f"error: {error}", file=sys.stderr)
        return 1
    _print(json.dumps(view, indent=1) if args.json else format_view(view))
    return 0


def _print(text: str) -> None:
    try:
        print(text, flush=True)
    except BrokenPipeError:  # `| head` closed the pipe
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def export(args: argparse.Namespace) -> int:
    run = _load(args.run)
    if run is None:
        return 1
    try:
        path = write_export(run, args.format, args.output)
    except OSError as error:
        print(f"error: cannot write {args.output}: {error}", file=sys.stderr)
        return 1
    print(f"wrote {path} ({args.format}: {len(run.spans)} spans, {len(run.requests)} requests)")
    return 0


def plot(args: argparse.Namespace) -> int:
    from tinyserve.trace_reading import plots

    run = _load(args.run)
    if run is None:
        return 1
    if not run.requests:
        print(f"error: run {run.name} has no requests to plot", file=sys.stderr)
        return 1
    folder = Path(args.output_dir)
    folder.mkdir(parents=True, exist_ok=True)
    for name in PLOTS:
        figure = getattr(plots, f"plot_{name}")(run)
        # The figures are bare matplotlib Figures: saving a PNG renders it with Agg, no GUI backend involved.
        figure.savefig(folder / f"{name}.png", dpi=110)
        print(f"wrote {folder / f'{name}.png'}")
    if run.has_block_tables:  # runs recorded before the steps logged their block tables have no map
        from tinyserve.trace_reading.plots_blocks import plot_block_map

        for engine_index in run.engine_indices:
            name = f"block_map_engine_{engine_index}.png"
            plot_block_map(run, engine_index).savefig(folder / name, dpi=110)
            print(f"wrote {folder / name}")
    return 0


# The model comes from --model or the manifest; the replay engine runs untraced, so that it
# never writes into the run folder it is checking.
_NOT_REPLAYED = {"model", "trace_run_dir", "otlp_endpoint"}


def _engine_kwargs(manifest: dict) -> dict:
    """The manifest's engine arguments that LLM(...) accepts, minus the model and tracing."""
    from dataclasses import fields

    from tinyserve.config import EngineArgs

    accepted = {f.name for f in fields(EngineArgs)} - _NOT_REPLAYED
    return {key: value for key, value in manifest.get("engine_args", {}).items() if key in accepted}


def model_mismatch(manifest: dict, model_path) -> str | None:
    """Why replay on this model cannot match, in words, before any token is compared; None if it can."""
    from tinyserve.models.fingerprint import manifest_fingerprint

    recorded, here = manifest.get("model_fingerprint"), manifest_fingerprint(model_path)
    if recorded is None:
        return ("note: the run's manifest records no model fingerprint (an older run, or a model too large to "
                "hash): a mismatch below may mean other weights")
    if recorded != here:
        return (f"warning: the run was recorded with model fingerprint {recorded[:12]}…, this model ({model_path}) "
                f"is {(here or 'unknown')[:12]}…: outputs will differ; pass --model with the model that served it")
    return None


def replay(args: argparse.Namespace) -> int:
    from tinyserve.entrypoints.llm import LLM
    from tinyserve.trace_reading.replay import replay_run

    run = _load(args.run)
    if run is None:
        return 1
    model = args.model or run.manifest.get("model")
    try:
        requests = None if args.request_id is None else [run.request(r).request_id for r in args.request_id]
        llm = LLM(model, **_engine_kwargs(run.manifest))
    except (ValueError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    mismatch = model_mismatch(run.manifest, llm.model_info.path)
    if mismatch is not None:
        print(mismatch)
    results = replay_run(run, llm, requests)
    for result in results:
        print(result.describe())
    matched = sum(r.matched for r in results)
    skipped = sum(r.skipped for r in results)
    mismatched = len(results) - matched - skipped
    partial = sum(r.note is not None for r in results if not r.skipped)
    print(f"replayed {len(results)} requests: {matched} match, {mismatched} mismatch, {skipped} skipped"
          + (f" ({partial} compared in part: aborted ones up to where they stopped, pooled ones by their "
             "vector's length)" if partial else ""))
    return 1 if mismatched else 0


def merge(args: argparse.Namespace) -> int:
    from tinyserve.trace_reading.merge import merge_runs

    try:
        folder = merge_runs(args.runs, args.output)
        run = load_run(folder)
    except (ValueError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(f"wrote {folder}: {len(args.runs)} run folders, engines {run.engine_indices}, {len(run.requests)} requests")
    return 0
