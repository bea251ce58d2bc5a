"""--trace-max-mb: a run folder stays under its cap; the oldest engine steps go first, counted.

The cap is the whole folder's, offline and for a server's processes together. The request
spans stay whole, so every request can still be read and replayed, the steps that remain
are the newest, and manifest.json counts the rest.
"""

import json
import signal
from unittest.mock import ANY

import httpx
import pytest

from tests.tiny_checkpoints import tiny_model_with_tokenizer
from tinyserve import LLM, SamplingParams
from tinyserve.lifecycle import schema
from tinyserve.lifecycle.otlp_capped import SEGMENTS
from tinyserve.lifecycle.tracing import shutdown_tracing
from tinyserve.testing import ServerProcess
from tinyserve.trace_reading import load_run
from tinyserve.trace_reading.replay import replay_run
from tinyserve.trace_reading.summary import summarize

CAP_MB = 0.15  # 150 kB: the requests of the run below (in their half) and a few dozen of its 120 steps


def folder_bytes(folder) -> int:
    return sum(p.stat().st_size for p in folder.iterdir() if p.suffix == ".jsonl")


def generate_traced(trace_dir, trace_max_mb, num_prompts=6, max_tokens=40):
    try:
        llm = LLM(str(tiny_model_with_tokenizer("llama")), trace_dir=str(trace_dir), trace_max_mb=trace_max_mb,
                  num_kv_blocks=64, max_num_seqs=2)
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        llm.generate([{"prompt_token_ids": list(range(5 + i, 25 + i))} for i in range(num_prompts)], params,
                     use_tqdm=False)
    finally:
        shutdown_tracing()
    [run_dir] = list(trace_dir.iterdir())
    return run_dir


@pytest.fixture(scope="module")
def capped_and_whole(tmp_path_factory):
    capped = generate_traced(tmp_path_factory.mktemp("capped"), CAP_MB)
    whole = generate_traced(tmp_path_factory.mktemp("whole"), None)
    return load_run(capped), load_run(whole)


def test_the_capped_run_is_under_its_cap_and_the_whole_one_is_not(capped_and_whole):
    capped, whole = capped_and_whole
    assert folder_bytes(whole.path) > 2 * CAP_MB * 1e6  # the cap had work to do
    assert folder_bytes(capped.path) <= CAP_MB * 1e6
    assert oct(next(capped.path.glob("*.steps-*.jsonl")).stat().st_mode & 0o777) == "0o600"


def test_the_oldest_steps_were_dropped_and_counted_in_the_manifest(capped_and_whole):
    capped, whole = capped_and_whole
    dropped = capped.manifest[schema.MANIFEST_DROPPED][schema.OFFLINE_TRACE_FILE]
    assert capped.manifest["trace_max_mb"] == CAP_MB and whole.dropped_steps == 0
    assert dropped["steps"] == capped.dropped_steps > 0
    assert len(capped.steps) + capped.dropped_steps == len(whole.steps)
    kept = [s.step_id for s in capped.steps]
    assert kept == [s.step_id for s in whole.steps][-len(kept):]  # the newest ones, none missing among them
    assert f"the {capped.dropped_steps} oldest engine steps were dropped" in summarize(capped)


def test_every_request_is_whole_and_replays_from_the_capped_run(capped_and_whole):
    capped, whole = capped_and_whole
    assert [r.completions[0].token_ids for r in capped.requests] == [r.completions[0].token_ids
                                                                     for r in whole.requests]
    llm = LLM(str(tiny_model_with_tokenizer("llama")), num_kv_blocks=64)
    assert all(result.matched for result in replay_run(capped, llm))


def test_block_tables_of_a_capped_run_are_those_of_the_whole_run_where_known(capped_and_whole):
    capped, whole = capped_and_whole
    full_tables = whole.block_tables(0)
    for step_id, tables in capped.block_tables(0).items():
        for request_id, blocks in tables.items():
            assert blocks == full_tables[step_id][request_id]


@pytest.mark.server
def test_a_capped_servers_engine_drops_its_oldest_steps_to_keep_the_folder_under_the_cap(tmp_path):
    server = ServerProcess(str(tiny_model_with_tokenizer("llama")), "--served-model-name", "tiny", "--trace",
                           "--trace-dir", str(tmp_path), "--trace-max-mb", str(CAP_MB), "--num-kv-blocks", "64")
    try:
        for i in range(4):
            body = {"model": "tiny", "prompt": f"count {i}", "max_tokens": 48, "ignore_eos": True,
                    "temperature": 0.0}
            assert httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).status_code == 200
    finally:
        server.stop(signal.SIGTERM)
    [run_dir] = list(tmp_path.iterdir())
    manifest = json.loads((run_dir / schema.MANIFEST_FILE).read_text())
    assert manifest["trace_max_mb"] == CAP_MB
    assert manifest["engine_args"]["trace_max_bytes"] == int(CAP_MB * 1e6)
    assert folder_bytes(run_dir) <= CAP_MB * 1e6 * (1 + 1 / SEGMENTS)  # the engine's newest segment may stay
    assert manifest[schema.MANIFEST_DROPPED] == {schema.engine_trace_file(0): {"steps": ANY, "spans": ANY}}
    assert manifest[schema.MANIFEST_DROPPED][schema.engine_trace_file(0)]["steps"] > 0
    run = load_run(run_dir)
    assert len(run.requests) == 4 and all(r.completions[0].finish_reason == "length" for r in run.requests)


def test_when_request_spans_fill_their_share_new_ones_are_dropped_and_counted_and_the_newest_steps_stay(tmp_path):
    run_dir = generate_traced(tmp_path, 0.024, num_prompts=8, max_tokens=8)  # 24 kB: half is 2 requests' spans
    run = load_run(run_dir)
    dropped = run.manifest[schema.MANIFEST_DROPPED][schema.OFFLINE_TRACE_FILE]
    assert folder_bytes(run_dir) <= 24_000 * (1 + 1 / SEGMENTS)
    assert run.steps and run.steps[-1].step_id == max(s.step_id for s in run.steps)  # the last steps are there
    # the run's very last steps: the one that finished its last requests, and the empty one that released them
    last_work = [s for s in run.steps if s.request_ids][-1]
    assert last_work.finished_request_ids
    assert set(run.steps[-1].released_request_ids) == set(last_work.finished_request_ids)
    assert dropped["spans"] > dropped["steps"] * len(schema.STEP_SPANS) > 0  # steps, and request spans too
    assert 0 < len(run.requests) < 8
