"""merge_runs: the run folders of several nodes → one run folder, as if one machine wrote it.

With engines on several nodes (multi-node data parallel), each node traces into
a folder of its own: the head's holds api.jsonl and its engines' files, a headless
node's only its engines' (engine-2.jsonl, ...). The spans already belong
together: a request's trace context travels with it to the remote engine
(EngineCoreRequest.trace_context), so its engine spans carry the API's trace id.
Merging is therefore a copy: every span file of every folder into one, and one
manifest, the head's, that lists each node under "nodes". load_run then joins the
spans by trace id as for any run.

TTFT is the one metric that subtracts a remote engine's clock from the head's
(run.py): on two machines it is as good as their clock sync (NTP: a millisecond or so).
"""

import json
import shutil
from pathlib import Path

from tinyserve.lifecycle import schema


def merge_runs(folders: list[str | Path], output: str | Path) -> Path:
    """Copy the span files of `folders` (the head's first, or anywhere) into `output`, a new folder."""
    runs = [Path(folder) for folder in folders]
    manifests = [_manifest(run) for run in runs]
    heads = [run for run, manifest in zip(runs, manifests) if not manifest.get(schema.MANIFEST_NODE, {}).get("headless")]
    if len(heads) != 1:
        names = ", ".join(str(run) for run in heads) or "none"
        raise ValueError(f"merging needs exactly one head node's run (the others --headless); got {len(heads)}: {names}")
    owner: dict[str, Path] = {}
    for run in runs:
        for file in sorted(run.glob("*.jsonl")):
            if file.name in owner:
                raise ValueError(f"both {owner[file.name]} and {run} have {file.name}: two nodes wrote the same "
                                 "rank's spans, or one run was given twice")
            owner[file.name] = run
    out = Path(output)
    if out.exists():
        raise ValueError(f"output {str(out)!r} exists already; merge writes a new folder")
    out.mkdir(parents=True)
    for name, run in owner.items():
        shutil.copyfile(run / name, out / name)
    head_manifest = manifests[runs.index(heads[0])]
    merged = dict(head_manifest)
    merged[schema.MANIFEST_NODES] = [{"run": str(run), **manifest.get(schema.MANIFEST_NODE, {})}
                                     for run, manifest in zip(runs, manifests)]
    dropped = {}
    for manifest in manifests:
        dropped.update(manifest.get(schema.MANIFEST_DROPPED, {}))
    if dropped:
        merged[schema.MANIFEST_DROPPED] = dropped
    (out / schema.MANIFEST_FILE).write_text(json.dumps(merged, indent=2))
    return out


def _manifest(run: Path) -> dict:
    path = run / schema.MANIFEST_FILE
    if not path.is_file():
        raise ValueError(f"path {str(run)!r} is not a tinyserve run folder: it has no {schema.MANIFEST_FILE}")
    return json.loads(path.read_text(encoding="utf-8"))
