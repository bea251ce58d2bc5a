"""merge_runs: the run folders of several nodes → one run folder, as if one machine wrote it.

With engines on several nodes (multi-node data parallel), each node traces into
a folder of its own: the head's holds api.jsonl and its engines' files, a headless
node's only its engines' (engine-2.jsonl, ...). Behind an external load balancer,
each rank's server writes its own folder, with an API and one engine. The spans already belong
together: a request's trace context travels with it to the remote engine
(EngineCoreRequest.trace_context), so its engine spans carry the API's trace id.
Merging is therefore a copy: every span file of every folder into one, and one
manifest, the head's, that lists each node under "nodes". load_run then joins the
spans by trace id as for any run.

A `tinyserve router` in front of --data-parallel-rank servers traces into a folder of its
own too, router.jsonl beside a manifest whose node says "router": its spans are the
parents of the backends' HTTP spans (the router sends traceparent), so the same copy
joins them. Its manifest is never the merged one: a backend's says what was served.

TTFT is the one metric that subtracts a remote engine's clock from the head's
(run.py): on two machines it is as good as their clock sync (NTP: a millisecond or so).
"""

import json
import shutil
from pathlib import Path

from tinyserve.lifecycle import schema


def merge_runs(folders: list[str | Path], output: str | Path) -> Path:
    """Copy the span files of `folders` into `output`, a new folder, with one manifest.

    The folders are a head's and its headless nodes', or the servers of several
    --data-parallel-rank ranks behind a load balancer: each of those has an API of its
    own, and its api.jsonl becomes api-<rank>.jsonl here.
    """
    runs = [Path(folder) for folder in folders]
    manifests = [_manifest(run) for run in runs]
    nodes = [manifest.get(schema.MANIFEST_NODE, {}) for manifest in manifests]
    with_api = [run for run, node in zip(runs, nodes) if not node.get("headless") and not node.get("router")]
    if not with_api:
        raise ValueError("merging needs the run of a node that served the API (all of these are --headless "
                         "or routers)")
    owner: dict[str, Path] = {}
    for run, node in zip(runs, nodes):
        for file in sorted(run.glob("*.jsonl")):
            name = file.name
            if name == schema.API_TRACE_FILE and len(with_api) > 1:
                name = schema.api_trace_file(node.get("ranks", [None])[0])
            if name in owner:
                raise ValueError(f"both {owner[name]} and {run} have {name}: two nodes wrote the same "
                                 "rank's spans, or one run was given twice")
            owner[name] = run / file.name
    out = Path(output)
    if out.exists():
        raise ValueError(f"output {str(out)!r} exists already; merge writes a new folder")
    out.mkdir(parents=True)
    for name, source in owner.items():
        shutil.copyfile(source, out / name)
    merged = dict(manifests[runs.index(with_api[0])])
    merged.pop(schema.MANIFEST_NODE, None)
    merged[schema.MANIFEST_NODES] = [{"run": str(run), **node} for run, node in zip(runs, nodes)]
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
