"""benchmarks/gpu_check.py keeps what it measured: rows on disk as each part ends, failures as rows.

A GPU run is short and may be the only one, so the script is tested here, on the CPU:
--smoke runs every part's code on tiny sizes (kernels through Triton's interpreter). The
whole smoke run is checked once, inside the offline-install rehearsal
(tests/test_offline_install.py, with check_smoke_run below); here, part 1 of it.
"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from tests.pythons import ROOT

SCRIPT = ROOT / "benchmarks" / "gpu_check.py"
PART_FILES = ["1-kernels.jsonl", "2-speed.jsonl", "3-end-to-end.jsonl", "4-tensor-parallel.jsonl"]


def read_rows(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def check_smoke_run(stdout: str, out_dir) -> None:
    """What a whole `gpu_check.py --smoke --out out_dir` must print and write: the plan, one file a part,
    every case within tolerance or identical, no FAILED row.

    tests/test_offline_install.py runs that smoke run, in the rehearsed offline install (the
    environment it exists for), and checks it with this; a second run here would only repeat it.
    """
    assert "\ndevice: CPU (smoke run" in "\n" + stdout
    out = stdout[stdout.index("device: CPU (smoke run"):]
    for number, name in enumerate(["kernels", "speed", "end to end", "tensor parallel"], 1):
        assert f"  part {number}, {name}: about " in out and f"  part {number} done in " in out
    assert sorted(path.name for path in out_dir.iterdir()) == PART_FILES
    kernels, speed, end_to_end, tensor_parallel = (read_rows(out_dir / name) for name in PART_FILES)
    assert kernels[0]["result"] == "all within tolerance"
    assert {row["what"].split()[0] for row in kernels[1:]} == {"decode", "prefill", "store_kv"}
    assert any(row["what"] == "device copy bandwidth (read + write)" for row in speed)
    results = {row["what"]: row["result"] for row in end_to_end}
    for contender in ("transformers generate (sdpa, DynamicCache)", "tinyserve (CUDA graphs)",
                      "tinyserve --enforce-eager"):
        for size in (1, 2):  # the smoke run's batch sizes (a GPU run's: 1 and 64)
            want = f"identical {size}/{size}, mean matched prefix 4.0/4 tokens"
            assert want in results[f"batch {size}: {contender}"], (size, contender)
    assert results["fp32 parity: tinyserve (CUDA graphs) against transformers"].startswith("identical 2/2")
    assert any(what.startswith("DecodeGraphs.run alone") for what in results)
    traced = [result for what, result in results.items() if what.startswith("a decode step of 2 sequences, CUDA "
                                                                              "graphs, traced (median of ")]
    assert len(traced) == 1 and ": schedule " in traced[0] and "; between steps " in traced[0]
    results = {row["what"]: row["result"] for row in tensor_parallel}
    for contender in ("TP=1, a one-rank gloo group", "TP=2 over gloo"):
        assert "identical 2/2, mean matched prefix 4.0/4 tokens" in results[contender], contender
    assert results["TP=2 over gloo: per rank, per step"].startswith("rank 0 (cpu): execute ")
    assert "; rank 1 (cpu): execute " in results["TP=2 over gloo: per rank, per step"]
    assert any(what.startswith("one all_reduce alone over the one-rank group") for what in results)
    assert results["fp32 parity: TP=2 against transformers"].startswith("identical 2/2")
    parts = (kernels, speed, end_to_end, tensor_parallel)
    assert not any(row["result"].startswith("FAILED") for rows in parts for row in rows)


@pytest.mark.slow
@pytest.mark.interpreter
def test_a_run_killed_after_part_1_leaves_part_1s_rows_on_disk(tmp_path):
    process = subprocess.Popen([sys.executable, str(SCRIPT), "--smoke", "--out", str(tmp_path)], cwd=ROOT,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    first = tmp_path / PART_FILES[0]
    deadline = time.monotonic() + 240
    while not first.exists() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=30)
    assert process.returncode == -signal.SIGKILL  # killed mid-run, not finished
    assert not (tmp_path / PART_FILES[2]).exists()
    rows = read_rows(first)
    assert rows[0]["part"] == "kernels" and rows[0]["result"] == "all within tolerance"
    assert len(rows) > 1


def test_a_failing_case_is_a_row_and_the_run_goes_on(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import gpu_check
    from gpu_check_common import Row

    def broken(device, smoke):
        raise RuntimeError("out of resources: shared memory")

    def fine(device, smoke):
        return [Row("fine", "a measurement", "42")]

    monkeypatch.setattr(gpu_check, "plan", lambda: [("broken", broken, 1.0), ("fine", fine, 1.0)])
    assert gpu_check.main(["--smoke", "--out", str(tmp_path)]) == 1  # a failure is reported in the exit status
    [failed] = read_rows(tmp_path / "1-broken.jsonl")
    assert failed["result"].startswith("FAILED: RuntimeError: out of resources: shared memory")
    assert read_rows(tmp_path / "2-fine.jsonl") == [{"part": "fine", "what": "a measurement", "result": "42"}]


def test_an_engine_that_fails_to_start_is_a_failed_row_and_the_tensor_parallel_part_goes_on(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import gpu_check_tensor_parallel as part

    def no_engine(*args, **kwargs):
        raise RuntimeError("NCCL error: unhandled system error")

    monkeypatch.setattr(part, "run_engine", no_engine)
    rows = part.tensor_parallel(torch.device("cpu"), smoke=True)
    failed = {row.what: row.result for row in rows if row.failed}
    assert list(failed) == ["TP=1, no process group", "TP=1, a one-rank gloo group", "TP=2 over gloo", "fp32 parity"]
    assert all(result.startswith("FAILED: RuntimeError: NCCL error") for result in failed.values())


def test_a_one_rank_group_whose_tokens_differ_from_the_plain_paths_is_a_failed_row(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from gpu_check_tensor_parallel import PLAIN, Run, compared

    runs = {PLAIN: Run([[1, 2, 3]], 1.0, []), "one rank": Run([[1, 2, 4]], 1.0, [])}
    row = compared("one rank", runs, output_tokens=3, must_match=True)
    assert row.failed and "identical 0/1, mean matched prefix 2.0/3 tokens" in row.result
    assert not compared("one rank", runs, output_tokens=3, must_match=False).failed


def test_a_missing_package_stops_the_run_before_anything_runs_with_one_message(tmp_path):
    # msgspec made unimportable, as on a GPU image that lacks it.
    code = ("import runpy, sys; sys.modules['msgspec'] = None; "
            f"sys.argv = [{str(SCRIPT)!r}, '--smoke', '--out', {str(tmp_path / 'out')!r}]; "
            f"runpy.run_path({str(SCRIPT)!r}, run_name='__main__')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 2
    assert done.stderr.startswith("gpu_check: cannot start, nothing was run.")
    assert "msgspec" in done.stderr and "Installing on an offline GPU server" in done.stderr
    assert done.stdout == "" and not (tmp_path / "out").exists()


def test_without_a_gpu_it_says_so_and_measures_nothing():
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    assert done.returncode == 2
    assert "no CUDA GPU on this machine" in done.stderr and done.stdout == ""
