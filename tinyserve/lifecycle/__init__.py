"""Lifecycle tracing: the span schema, and the readers of a traced run.

    from tinyserve.lifecycle import load_run, summarize, plots, replay_run
    run = load_run("traces/my-run")          per-request timelines, per-step records
    print(summarize(run))
    plots.plot_request_waterfall(run)
    replay_run(run, LLM(run.manifest["model"]))

The names below are imported on first use, so `import tinyserve.lifecycle.schema`
(which every process does) loads neither matplotlib nor the readers.
"""

import importlib

_EXPORTS = {
    "load_run": "tinyserve.lifecycle.run",
    "Run": "tinyserve.lifecycle.run",
    "RequestTimeline": "tinyserve.lifecycle.timeline",
    "SequenceTimeline": "tinyserve.lifecycle.timeline",
    "StepRecord": "tinyserve.lifecycle.step_record",
    "summarize": "tinyserve.lifecycle.summary",
    "to_jaeger": "tinyserve.lifecycle.export",
    "to_perfetto": "tinyserve.lifecycle.export",
    "write_export": "tinyserve.lifecycle.export",
    "replay_run": "tinyserve.lifecycle.replay",
    "ReplayResult": "tinyserve.lifecycle.replay",
}
_MODULES = {"plots": "tinyserve.lifecycle.plots"}
__all__ = [*_EXPORTS, *_MODULES]


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    if name in _MODULES:
        return importlib.import_module(_MODULES[name])
    raise AttributeError(f"module 'tinyserve.lifecycle' has no attribute {name!r}")
