"""A trace file under a run-wide size cap: engine steps go first, oldest first (`--trace-max-mb`).

A busy server writes one `tinyserve.step` span (and its schedule/execute/update children)
per engine step, for as long as it runs: that is most of a run's bytes, and the part a
reader can best do without, since each request's own spans hold its inputs, outputs and
stage times. So a capped process writes its step spans into numbered segment files

    engine-0.jsonl                   the request spans (queue, prefill, decode), as before
    engine-0.steps-000001.jsonl      step spans, oldest segment first
    engine-0.steps-000002.jsonl      ...

The cap is the whole run folder's: every process of the run (the API server, each engine)
adds up the sizes of all the folder's trace files before it writes. Past the cap, it removes
the run's least recently written segment, of any engine, but never one an engine may still
be writing (its newest): so the folder may pass the cap by up to a segment (an eighth of
the cap) per engine. Request spans are written while they fit in REQUEST_SHARE of the
cap, and new ones are dropped after that: the rest of the cap is the steps', so a busy run
keeps its newest steps however many requests it serves. Every drop is counted in the run's manifest.json, under
"dropped" and the file's name: {"steps": step spans dropped, "spans": every span dropped}.
load_run reads the segments like any other file, and Run.block_tables leaves out the
requests whose table began in a dropped step.
"""

import fcntl
import json
import os
from collections.abc import Sequence
from pathlib import Path

import msgspec
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExportResult

from tinyserve.lifecycle import schema
from tinyserve.lifecycle.otlp_file import OTLPJsonFileExporter, open_owner_only, spans_to_otlp_json

SEGMENTS = 8  # a run's steps are kept in about this many files per engine: dropping one frees a part
REQUEST_SHARE = 0.5  # of the cap, the most the request spans may take; the steps have the rest at least
_SEGMENT_MARK = ".steps-"


class CappedOTLPJsonFileExporter(OTLPJsonFileExporter):
    def __init__(self, path: str | Path, max_bytes: int) -> None:
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive, got {max_bytes}")
        super().__init__(path)
        self.max_bytes = max_bytes
        self.segment_bytes = max(1, max_bytes // SEGMENTS)
        self._segment_file = None  # the newest segment, the only one this process still writes
        self._segment_path: Path | None = None
        self._segment_number = 0
        self._segment_size = 0

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        steps = [s for s in spans if s.name in schema.TIMELINE_SPANS]
        others = [s for s in spans if s.name not in schema.TIMELINE_SPANS]
        run_dir = self.path.parent
        with self._lock:
            if self._file.closed:
                return SpanExportResult.FAILURE
            for line, chunk in self._lines(others):
                if folder_bytes(run_dir, steps=False) + len(line) > self.max_bytes * REQUEST_SHARE:
                    record_dropped(run_dir, self.path.name, steps=0, spans=len(chunk))  # their share is full
                    continue
                while folder_bytes(run_dir) + len(line) > self.max_bytes and drop_oldest_segment(run_dir):
                    pass  # the oldest engine steps make room for request spans
                self._file.write(line)
                self._file.flush()
                self.num_exported += len(chunk)
            for line, chunk in self._lines(steps):
                self._write_steps(line)
                self.num_exported += len(chunk)
        return SpanExportResult.SUCCESS

    def _lines(self, spans: list[ReadableSpan]):
        """(line, spans) pieces of at most half a segment each, each part together (a step and its
        phases, a request's stages: _group): an offline run exports everything at once, and what
        is kept or dropped must still be a part of it."""
        if not spans:
            return
        line = _line(spans)
        groups = list(dict.fromkeys(map(_group, spans)))
        if len(line) <= self.segment_bytes // 2 or len(groups) == 1:
            yield line, spans
            return
        first = set(groups[:len(groups) // 2])
        yield from self._lines([s for s in spans if _group(s) in first])
        yield from self._lines([s for s in spans if _group(s) not in first])

    def _write_steps(self, line: bytes) -> None:
        """Append to the newest segment (starting one when it is full), then drop the oldest
        segments of the run while it is over the cap (this one too, once it is the last)."""
        if self._segment_file is None or self._segment_size + len(line) > self.segment_bytes:
            self._new_segment()
        self._segment_file.write(line)
        self._segment_file.flush()
        self._segment_size += len(line)
        run_dir = self.path.parent
        while folder_bytes(run_dir) > self.max_bytes:
            if not drop_oldest_segment(run_dir):
                if self._segment_size == 0:
                    break  # nothing of ours left to drop
                self._new_segment()  # close ours, so that it may go

    def _new_segment(self) -> None:
        if self._segment_file is not None:
            self._segment_file.close()
        self._segment_number += 1
        self._segment_path = self.path.with_name(schema.step_segment_file(self.path.name, self._segment_number))
        self._segment_file = open_owner_only(self._segment_path)
        self._segment_size = 0

    def shutdown(self) -> None:
        with self._lock:
            if self._segment_file is not None:
                self._segment_file.close()
                if self._segment_size == 0:  # started by the last drop, never written
                    self._segment_path.unlink(missing_ok=True)
        super().shutdown()


def _group(span: ReadableSpan) -> int:
    """What is kept or dropped together: a step and its phases (the steps of a timeline window share its
    trace, but each step is a part of its own), else a whole trace (a request's stages)."""
    if span.name == schema.STEP:
        return span.context.span_id
    if span.name in schema.STEP_SPANS and span.parent is not None:
        return span.parent.span_id
    return span.context.trace_id


def _line(spans: Sequence[ReadableSpan]) -> bytes:
    return msgspec.json.encode(spans_to_otlp_json(spans)) + b"\n"


def folder_bytes(run_dir: Path, steps: bool = True) -> int:
    """The bytes of every trace file of the run folder (with steps=False: less the step segments)."""
    total = 0
    with os.scandir(run_dir) as entries:
        for entry in entries:
            if entry.name.endswith(".jsonl") and (steps or _SEGMENT_MARK not in entry.name):
                try:
                    total += entry.stat().st_size
                except FileNotFoundError:  # another process just dropped it
                    pass
    return total


def drop_oldest_segment(run_dir: Path) -> bool:
    """Remove the run's least recently written step segment that no process still writes (each
    engine writes only its highest-numbered one) and count its spans. False: there is none."""
    by_file: dict[str, list[Path]] = {}
    for path in run_dir.glob(f"*{_SEGMENT_MARK}*.jsonl"):
        by_file.setdefault(path.name.split(_SEGMENT_MARK)[0], []).append(path)
    closed = []
    for paths in by_file.values():
        for path in sorted(paths)[:-1]:  # zero-padded numbers: sorted by name is sorted by number
            try:
                closed.append((path.stat().st_mtime_ns, path))
            except FileNotFoundError:
                pass
    for _, path in sorted(closed):
        try:
            text = path.read_text(encoding="utf-8")
            path.unlink()  # only one process can: the others see FileNotFoundError
        except FileNotFoundError:
            continue
        owner = path.name.split(_SEGMENT_MARK)[0] + ".jsonl"
        # Span names are JSON strings in the line: counting them is exact.
        spans = sum(text.count(f'"name":"{name}"') for name in schema.TIMELINE_SPANS)
        record_dropped(run_dir, owner, steps=text.count(f'"name":"{schema.STEP}"'), spans=spans)
        return True
    return False


def record_dropped(run_dir: Path, file_name: str, *, steps: int, spans: int) -> None:
    """Add to one file's drop counts in manifest.json; every process of a run may, so under a lock."""
    manifest_path = run_dir / schema.MANIFEST_FILE
    if not manifest_path.exists():  # a trace file outside a run folder: nowhere to say it
        return
    with open(run_dir / ".manifest.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        manifest = json.loads(manifest_path.read_text())
        counts = manifest.setdefault(schema.MANIFEST_DROPPED, {}).setdefault(file_name, {"steps": 0, "spans": 0})
        counts["steps"] += steps
        counts["spans"] += spans
        temporary = manifest_path.with_suffix(".tmp")
        temporary.write_text(json.dumps(manifest, indent=2, default=str))
        temporary.chmod(0o600)
        temporary.replace(manifest_path)
