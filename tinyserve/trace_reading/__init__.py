"""Reading a recorded run back: after the server ran, from its trace folder.

    from tinyserve.trace_reading import load_run, summarize, plots, replay_run
    run = load_run("traces/my-run")          per-request timelines, per-step records
    print(summarize(run))
    plots.plot_request_waterfall(run)
    replay_run(run, LLM(run.manifest["model"]))

    otlp_json         the trace files → plain Span objects
    run, timeline,    load_run: the spans joined into a Run of RequestTimelines and StepRecords
      step_record
    summary, views,   what `tinyserve trace summary | request | step` print
      views_text
    ttft              a request's TTFT cut into consecutive pieces (the CLI's and chapter 1's)
    plots*            the notebooks' figures (matplotlib)
    replay            re-run the logged requests on an engine the caller hands over
    export            a run for Jaeger or Perfetto
    merge             the run folders of several nodes → one

What writes the record while the server runs (the span schema, tracing set-up, span builders,
the file exporter) stays in tinyserve/lifecycle/; this package imports that and nothing else of
tinyserve. The names below are imported on first use, so importing one reader loads neither
matplotlib nor the others.
"""

import importlib

_EXPORTS = {
    "load_run": "tinyserve.trace_reading.run",
    "Run": "tinyserve.trace_reading.run",
    "RequestTimeline": "tinyserve.trace_reading.timeline",
    "SequenceTimeline": "tinyserve.trace_reading.timeline",
    "StepRecord": "tinyserve.trace_reading.step_record",
    "summarize": "tinyserve.trace_reading.summary",
    "to_jaeger": "tinyserve.trace_reading.export",
    "to_perfetto": "tinyserve.trace_reading.export",
    "write_export": "tinyserve.trace_reading.export",
    "replay_run": "tinyserve.trace_reading.replay",
    "ReplayResult": "tinyserve.trace_reading.replay",
}
_MODULES = {"plots": "tinyserve.trace_reading.plots"}
__all__ = [*_EXPORTS, *_MODULES]


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    if name in _MODULES:
        return importlib.import_module(_MODULES[name])
    raise AttributeError(f"module 'tinyserve.trace_reading' has no attribute {name!r}")
