"""Trace folders hold prompts and outputs: they are their owner's alone, and never shared by two runs."""

import stat

from tests.tiny_checkpoints import tiny_model_with_tokenizer
from tinyserve import LLM, SamplingParams
from tinyserve.lifecycle.tracing import new_run_dir, shutdown_tracing


def mode(path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_two_runs_started_in_the_same_second_get_their_own_folders(tmp_path):
    folders = [new_run_dir(tmp_path) for _ in range(3)]
    assert len(set(folders)) == 3 and all(folder.is_dir() for folder in folders)


def test_a_traced_runs_folder_and_files_are_owner_only(tmp_path):
    try:
        llm = LLM(str(tiny_model_with_tokenizer("llama")), trace_dir=str(tmp_path), num_kv_blocks=32)
        llm.generate("Secret prompt", SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)
    finally:
        shutdown_tracing()
    [run] = list(tmp_path.iterdir())
    files = list(run.iterdir())
    assert mode(run) == 0o700
    assert {f.name for f in files} >= {"manifest.json", "offline.jsonl"}
    assert all(mode(f) == 0o600 for f in files)


def test_sampled_requests_without_a_seed_are_replayable_from_their_trace(tmp_path):
    from tinyserve.trace_reading import load_run, replay_run

    model = str(tiny_model_with_tokenizer("llama"))
    unseeded = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=12, ignore_eos=True)
    try:
        llm = LLM(model, trace_dir=str(tmp_path), num_kv_blocks=32)
        first = llm.generate(["Beautiful is", "Flat is", "Sparse"], unseeded, use_tqdm=False)
        chat = llm.chat([{"role": "user", "content": "Hello"}], SamplingParams(temperature=0.9, n=2, max_tokens=8))
    finally:
        shutdown_tracing()
    assert all(o.outputs[0].token_ids for o in first + chat)
    [run_dir] = list(tmp_path.iterdir())
    run = load_run(run_dir)
    assert all(r.inputs.sampling_params.get("seed") is not None for r in run.requests)  # drawn and logged
    results = replay_run(run, LLM(model, num_kv_blocks=32))
    assert len(results) == 4 and all(r.matched and not r.skipped for r in results), [r.describe() for r in results]


def test_replay_on_another_model_says_so_before_comparing_any_token(tmp_path, capsys):
    from tinyserve.cli.main import main

    recorded_with = str(tiny_model_with_tokenizer("llama"))
    try:
        LLM(recorded_with, trace_dir=str(tmp_path), num_kv_blocks=32).generate(
            ["Flat is better"], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    finally:
        shutdown_tracing()
    [run_dir] = list(tmp_path.iterdir())
    capsys.readouterr()
    assert main(["trace", "replay", str(run_dir)]) == 0
    same = capsys.readouterr().out
    assert "fingerprint" not in same and "1 match" in same
    main(["trace", "replay", str(run_dir), "--model", str(tiny_model_with_tokenizer("qwen3"))])
    other = capsys.readouterr().out.splitlines()
    assert "recorded with model fingerprint" in other[0] and "outputs will differ" in other[0]


def test_summarize_names_the_model_and_lists_failed_requests(tmp_path):
    import pytest

    from tinyserve.trace_reading import load_run
    from tinyserve.trace_reading.summary import summarize

    try:
        llm = LLM(str(tiny_model_with_tokenizer("llama")), trace_dir=str(tmp_path), num_kv_blocks=32,
                  max_model_len=64)
        with pytest.raises(ValueError, match="max_model_len"):
            llm.generate([{"prompt_token_ids": [5, 6]}, {"prompt_token_ids": [7] * 100}],
                         SamplingParams(max_tokens=2), use_tqdm=False)
    finally:
        shutdown_tracing()
    [run_dir] = list(tmp_path.iterdir())
    lines = summarize(load_run(run_dir)).splitlines()
    assert f"model {llm.model_name}" in lines[0] and "None" not in lines[0]
    assert lines[1] == "errors: 2"
    assert lines[2].startswith("  0: ") and "max_model_len" in lines[3] and lines[3].startswith("  1: ")


def test_summarize_into_a_closed_pipe_ends_quietly(tmp_path):
    import subprocess
    import sys

    try:
        LLM(str(tiny_model_with_tokenizer("llama")), trace_dir=str(tmp_path), num_kv_blocks=32).generate(
            "Flat", SamplingParams(max_tokens=2), use_tqdm=False)
    finally:
        shutdown_tracing()
    [run_dir] = list(tmp_path.iterdir())
    process = subprocess.Popen([sys.executable, "-m", "tinyserve.cli.main", "trace", "summarize", str(run_dir)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    process.stdout.close()  # as `| head -0` would: gone before the summary is written
    stderr = process.stderr.read().decode()
    assert process.wait(timeout=60) == 0 and "Traceback" not in stderr and "BrokenPipe" not in stderr
