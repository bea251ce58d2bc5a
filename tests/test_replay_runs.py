"""Every shipped run under traces/ replays: 0 skipped, 0 mismatched (replay.py, `tinyserve trace replay`).

Each run is replayed as `tinyserve trace replay` does it: on an in-process LLM built from the
run's manifest (its model, its engine arguments: tensor- and pipeline-parallel sizes, the LoRA
and speculative settings, the KV connector's role), on the CPU. A run of several engines
(data-parallel ranks, a head and its node, two servers behind a router or nginx) is replayed on
one engine configured as each of them was, since they all ran with the manifest's arguments and a
greedy or seeded request's tokens do not depend on the engine or the batch that served it. The P/D
pair is two runs: the decode server's (each request replayed whole, its K/V computed here instead
of received) and prefill/ (each request's one prefill token).

Aborted requests (a client left; a node died under them) are replayed up to where they stopped
and compared on that prefix; pooled ones by the length of their vector, which is all of it the
run logs. recorded-lora's adapters are its own files, adapters/<name>/, made again byte for byte
by scripts/record_traces.py's make_adapter.
"""

import json
import shutil
from pathlib import Path

import pytest

from tinyserve.cli.trace import _engine_kwargs
from tinyserve.trace_reading import load_run
from tinyserve.trace_reading.replay import ADAPTERS_FOLDER, _local, aborted, replay_run

ROOT = Path(__file__).resolve().parents[1]
# every run folder shipped: recorded-*/ and the runs inside them (recorded-pd-disaggregated/prefill/)
SHIPPED = sorted(p.parent for p in ROOT.glob("traces/recorded-*/**/manifest.json"))


def _config(folder: Path) -> tuple:
    manifest = load_run(folder).manifest
    return manifest.get("model") or "", repr(sorted(_engine_kwargs(manifest).items()))


# runs of the same engine configuration one after the other, so that they share one engine
BY_CONFIG = sorted(SHIPPED, key=lambda folder: (_config(folder), folder))


@pytest.fixture(scope="module")
def engine_for():
    """An LLM configured as the run's manifest says (one at a time: the last is shut down when the next differs)."""
    from tinyserve import LLM

    held: dict = {}

    def get(run):
        key = (run.manifest.get("model") or "", repr(sorted(_engine_kwargs(run.manifest).items())))
        if key not in held:
            for llm in held.values():
                llm.shutdown()
            held.clear()
            held[key] = LLM(run.manifest.get("model"), **_engine_kwargs(run.manifest))
        return held[key]

    yield get
    for llm in held.values():
        llm.shutdown()


def test_every_run_folder_is_found():
    assert len(SHIPPED) >= 24 and ROOT / "traces/recorded-pd-disaggregated/prefill" in SHIPPED
    assert (ROOT / "traces/recorded-lora/adapters/sql/adapter_model.safetensors").is_file()


@pytest.mark.slow
@pytest.mark.parametrize("folder", BY_CONFIG, ids=lambda p: str(p.relative_to(ROOT / "traces")))
def test_shipped_run_replays_with_nothing_skipped_and_nothing_mismatched(folder, engine_for):
    from tinyserve.models.default_model import DEFAULT_MODEL_FINGERPRINT, DEFAULT_VISION_FINGERPRINT

    run = load_run(folder)
    vision = run.manifest.get("model") == "tinyserve-vision"
    shipped = DEFAULT_VISION_FINGERPRINT if vision else DEFAULT_MODEL_FINGERPRINT
    assert run.manifest["model_fingerprint"] == shipped  # a shipped model: it replays here
    results = replay_run(run, engine_for(run))
    assert len(results) == len(run.requests) > 0
    assert [r.describe() for r in results if not r.matched] == []
    for request, result in zip(run.requests, results):
        if aborted(request):  # replayed to where it stopped, never past it
            stopped = max(len(c.token_ids) for c in request.completions)
            assert _local(request)["max_tokens"] == max(1, stopped)
            assert result.note.startswith("aborted"), result.describe()
        elif request.inputs.pooling_params is not None:
            assert result.note.startswith("pooling: a vector of"), result.describe()
        else:
            assert result.note is None and request.error is None


@pytest.mark.slow
def test_recorded_lora_replays_from_its_own_adapters_and_they_matter(tmp_path):
    """The proof the adapters are the recording's: under them the 6 adapter requests give the logged
    tokens (above); without them, the logged paths (a recording's temporary folder) do not load, and
    under the base model each adapter's requests give other tokens."""
    from tinyserve import LLM

    copy = tmp_path / "recorded-lora"
    shutil.copytree(ROOT / "traces/recorded-lora", copy, ignore=shutil.ignore_patterns(ADAPTERS_FOLDER))
    run = load_run(copy)
    llm = LLM(**_engine_kwargs(run.manifest))
    try:
        results = replay_run(run, llm)
        adapted = [r for r in run.requests if r.inputs.lora_request]
        assert len(adapted) == 6
        skipped = {r.request_id for r in results if r.skipped}
        assert skipped == {r.request_id for r in adapted}
        base = llm.generate([{"prompt_token_ids": r.inputs.prompt_token_ids} for r in adapted],
                            [_local(r) for r in adapted], use_tqdm=False)
        # each adapter changes the tokens of some of its requests (of these 6, 4: the others' short outputs
        # are the base model's too), so their matching under the shipped files is no accident
        changed = {r.inputs.lora_request["lora_name"] for r, out in zip(adapted, base)
                   if list(out.outputs[0].token_ids) != r.completions[0].token_ids}
        assert changed == {"sql", "chat"}
    finally:
        llm.shutdown()


def peft_settings(path: Path) -> dict:
    """An adapter_config.json's settings: without the PEFT release that wrote it, and without the settings left
    null, which a later release adds to every config it writes (PEFT 0.22's astra_config, say)."""
    config = json.loads(path.read_text())
    config.pop("peft_version", None)
    return {key: value for key, value in config.items() if value is not None}


@pytest.mark.slow
def test_recorded_lora_adapters_are_made_again_byte_for_byte(tmp_path):
    """scripts/record_traces.py's make_adapter, from the recipe's seeds, writes the shipped weights exactly, and
    the same settings (whichever PEFT release writes them: it stamps its version in the config)."""
    from tests.test_notebooks import record_traces

    shipped = ROOT / "traces/recorded-lora" / ADAPTERS_FOLDER
    recipe = record_traces.RECORDINGS["lora"]
    assert sorted(p.name for p in shipped.iterdir()) == sorted(recipe.adapters)
    for seed, name in enumerate(recipe.adapters, start=1):
        made = record_traces.make_adapter(tmp_path / name, seed)
        assert sorted(p.name for p in made.iterdir()) == sorted(p.name for p in (shipped / name).iterdir())
        for path in made.iterdir():
            if path.name == "adapter_config.json":
                assert peft_settings(path) == peft_settings(shipped / name / path.name), name
            else:
                assert path.read_bytes() == (shipped / name / path.name).read_bytes(), f"{name}/{path.name}"
