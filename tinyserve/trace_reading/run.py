"""load_run: a trace folder → one timeline per request and one record per engine step.

A run folder (`traces/<run-name>/`) holds `manifest.json` and one OTLP-JSON-lines
file per process (`api.jsonl`, `engine-0.jsonl`, ... or `offline.jsonl`). Loading
it joins the spans of every process back together, by trace id:

    RequestTimeline   one per request span (`chat {model}` / `text_completion {model}`):
                      its request-wide stages (render, enqueue, detokenize, respond), one
                      SequenceTimeline per completion (n of them: ipc.send in the API, then
                      queue → prefill → decode in an engine), the logged inputs and
                      outputs, and the latency metrics below
    StepRecord        one per `tinyserve.step` span: what one engine step scheduled,
                      how full the KV cache was, and how long schedule/execute/update took

Metrics, as vLLM defines them (arrival = the request span's start, in the API or offline process):

    TTFT   first token − arrival; the first token's time is the engine's first entry in
           tinyserve.token_times_unix_nano (else the end of the prefill span). With n > 1,
           the earliest first token of any completion: the first one the client sees.
    TPOT   (last token − first token) / (output tokens − 1), from the engine's token times;
           with n > 1, summed over the completions: Σ(last − first) / Σ(tokens − 1).
    ITL    the gaps between consecutive token times, all completions together.
    E2E    the request span's duration (arrival → the last output handed back).

TTFT is the one metric that subtracts an engine clock from an API clock. Both are
time.time() of processes on the same host, so they agree to well under a millisecond;
queue, prefill, decode, TPOT and ITL use engine times only.
"""

import json
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from tinyserve.lifecycle import schema
from tinyserve.trace_reading.otlp_json import Span, read_spans
from tinyserve.trace_reading.step_record import StepRecord, step_record_from_span
from tinyserve.trace_reading.timeline import RequestTimeline, request_timeline_from_span


class Records(list):
    """A list of timelines or step records that pandas can take: `pd.DataFrame(run.steps.to_records())`."""

    def to_records(self) -> list[dict]:
        return [item.to_record() for item in self]


# ---- the run ----------------------------------------------------------------------------


@dataclass(eq=False)
class Run:
    path: Path
    manifest: dict
    spans: list[Span]  # every span of every process, by start time
    requests: Records  # RequestTimeline, by arrival
    steps: Records  # StepRecord, by start time (all engines)
    _block_tables: dict = field(default_factory=dict, repr=False)  # engine index -> block_tables(), built once

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def origin_ns(self) -> int:
        """The run's time zero: its first span's start (else the manifest's start time)."""
        if self.spans:
            return self.spans[0].start_ns
        return int(self.manifest.get("start_time_unix_nano", 0))

    @property
    def engine_indices(self) -> list[int]:
        found = {s.engine_index for s in self.steps} | {q.engine_index for r in self.requests for q in r.sequences}
        return sorted(i for i in found if i is not None)

    def engine_steps(self, engine_index: int) -> list[StepRecord]:
        return [s for s in self.steps if s.engine_index == engine_index]

    @property
    def dropped_steps(self) -> int:
        """Engine steps whose spans --trace-max-mb dropped (the oldest first), over every file."""
        dropped = self.manifest.get(schema.MANIFEST_DROPPED, {})
        return sum(counts.get("steps", 0) for counts in dropped.values())

    @property
    def has_block_tables(self) -> bool:
        """Whether the steps recorded their block-table changes (runs recorded before they did: not)."""
        return any(s.block_table_is_full for s in self.steps)

    @property
    def is_speculative(self) -> bool:
        """Whether the run's engines verified drafts (--speculative-config)."""
        return any(s.drafts for s in self.steps)

    @property
    def rollback_frees_recorded(self) -> bool:
        """Whether a speculative run's steps recorded the blocks each draft rollback freed (a run recorded
        before they did: not, and its block tables after a rollback still list the blocks it freed)."""
        return any(s.rollback_freed_block_ids is not None for s in self.steps)

    def block_tables(self, engine_index: int = 0) -> dict[int, dict[str, list[int]]]:
        """Every step's block tables on one engine: step id → {request id: physical block ids}.

        Rebuilt from the step spans alone, as the worker rebuilds them from SchedulerOutputs:
        at each step, drop the tables of requests released since the previous one and of
        those preempted now, then apply the step's new blocks. A table is what the
        request held while that step ran; a request that finished in a step still has it there.
        Under speculative decoding, the blocks a step's rollback freed (only rejected drafts
        reached them) are in its table and dropped from the next; a run recorded before steps
        logged those frees keeps them (`rollback_frees_recorded` says which).
        In a run capped by --trace-max-mb, a request whose whole table was sent in a dropped
        step is left out: only its later blocks are known.
        """
        if not self.has_block_tables:
            raise ValueError(f"run {self.name} has no block tables: it was recorded before steps logged them")
        if engine_index in self._block_tables:
            return self._block_tables[engine_index]
        tables: dict[str, list[int]] = {}
        by_step = {}
        for step in sorted(self.engine_steps(engine_index), key=lambda s: s.step_id):
            for request_id in step.released_request_ids + step.preempted_request_ids:
                tables.pop(request_id, None)
            for request_id, new_ids, full in zip(step.request_ids, step.new_block_ids, step.block_table_is_full):
                if full or request_id in tables:
                    tables[request_id] = list(new_ids) if full else tables[request_id] + new_ids
            by_step[step.step_id] = {request_id: list(ids) for request_id, ids in tables.items()}
            for request_id, freed in (step.rollback_freed_block_ids or {}).items():
                if freed and request_id in tables:
                    tables[request_id] = [b for b in tables[request_id] if b not in freed]
        self._block_tables[engine_index] = by_step
        return by_step

    def block_table(self, request_id: str, step_id: int, engine_index: int | None = None) -> list[int] | None:
        """The physical KV blocks `request_id` (an engine request id) held at `step_id`; None if it held none."""
        engines = [engine_index] if engine_index is not None else self.engine_indices
        for index in engines:
            step_tables = self.block_tables(index).get(step_id)
            if step_tables is not None and request_id in step_tables:
                return step_tables[request_id]
        return None

    def request(self, request_id: str) -> RequestTimeline:
        """The request with this id: the client's (gen_ai.response.id) or an engine request id.

        A text completion's id (cmpl-…) names all its prompts, each a request of its own, cmpl-…-0,
        cmpl-…-1, …: with one prompt, that one."""
        for timeline in self.requests:
            if request_id == timeline.request_id or request_id in (s.request_id for s in timeline.sequences):
                return timeline
        prompts = [t for t in self.requests if t.request_id.removeprefix(request_id + "-").isdigit()]
        if len(prompts) == 1:
            return prompts[0]
        if prompts:
            raise ValueError(f"request_id {request_id!r} is a completion of {len(prompts)} prompts, each a request: "
                             + ", ".join(t.request_id for t in prompts))
        known = ", ".join(t.request_id for t in self.requests[:5])
        raise ValueError(f"request_id {request_id!r} is not in run {self.name} (it has {len(self.requests)} "
                         f"requests{': ' + known if known else ''}{', ...' if len(self.requests) > 5 else ''})")


def load_run(path: str | Path) -> Run:
    """Read a run folder (manifest.json + one OTLP-JSON-lines file per process)."""
    folder = Path(path)
    if not folder.is_dir():
        raise ValueError(f"path {str(folder)!r} is not a run folder: no such directory")
    manifest_file = folder / schema.MANIFEST_FILE
    if not manifest_file.is_file():
        raise ValueError(f"path {str(folder)!r} is not a tinyserve run folder: it has no {schema.MANIFEST_FILE}")
    manifest = json.loads(manifest_file.read_text(encoding="utf-8"))
    spans = sorted((s for file in sorted(folder.glob("*.jsonl")) for s in read_spans(file)), key=lambda s: s.start_ns)
    traces: dict[str, list[Span]] = defaultdict(list)
    children: dict[str, list[Span]] = defaultdict(list)
    for span in spans:
        traces[span.trace_id].append(span)
        if span.parent_span_id:
            children[span.parent_span_id].append(span)
    requests = Records(request_timeline_from_span(span, _trace_of(span, traces[span.trace_id])) for span in spans
                       if schema.GEN_AI_OPERATION_NAME in span.attributes)
    steps = Records(step_record_from_span(span, children[span.span_id]) for span in spans if span.name == schema.STEP)
    return Run(folder, manifest, spans, requests, steps)


def _trace_of(request_span: Span, trace: list[Span]) -> list[Span]:
    """The spans of `trace` that belong to this request: its own, and those of no other request in the trace.

    One HTTP request may carry several requests, each with its request span under the HTTP span (the
    prompts of one completion, the inputs of one embedding request); each owns the spans below it.
    """
    requests = [s for s in trace if schema.GEN_AI_OPERATION_NAME in s.attributes]
    if len(requests) == 1:
        return trace
    by_id = {s.span_id: s for s in trace}
    request_ids = {s.span_id for s in requests}

    def owner(span: Span) -> str | None:
        seen = 0
        while span is not None and seen < len(trace):
            if span.span_id in request_ids:
                return span.span_id
            span, seen = by_id.get(span.parent_span_id), seen + 1
        return None

    return [s for s in trace if owner(s) in (None, request_span.span_id)]
