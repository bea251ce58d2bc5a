"""`tinyserve bench throughput`, `tinyserve bench serve` and benchmarks/compare.py, end to end.

The figures themselves (speed) are not checked: a shared CPU makes them noise. What is
checked is that each benchmark does the work it says (token counts from the server's own
usage, ignore_eos honoured, lengths in range), that its summary follows vLLM's metric
definitions when recomputed from the per-request data it saves, and that it prints
vLLM's table layout.
"""

import asyncio
import json
import math
import pathlib
import re
import statistics
import subprocess
import sys

import httpx
import numpy as np
import pytest
import torch

from tests.shared_server import MODEL
from tests.tiny_checkpoints import tiny_model_with_tokenizer
from tinyserve.bench import serve as serve_module
from tinyserve.bench.datasets import random_requests, vocabulary_pool
from tinyserve.bench.metrics import calculate_metrics
from tinyserve.bench.request_funcs import RequestFuncInput, RequestFuncOutput
from tinyserve.bench.vocabulary import server_vocabulary
from tinyserve.cli.main import main
from tinyserve.kernels.cpu_bf16 import computes_bf16_in_fp32
from tinyserve.models.tokenizer import load_tokenizer
from tinyserve.testing import free_port

REPO = pathlib.Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def folder() -> str:
    return str(tiny_model_with_tokenizer("llama"))


# ---- the random dataset ------------------------------------------------------------


def test_random_requests_have_lengths_in_range_and_no_special_tokens(folder):
    tokenizer = load_tokenizer(folder)
    pool = vocabulary_pool(len(tokenizer), tokenizer.all_special_ids)
    requests = random_requests(200, input_len=40, output_len=10, range_ratio=0.5, token_pool=pool, seed=3)
    assert all(20 <= r.prompt_len == len(r.prompt) <= 60 for r in requests)
    assert all(5 <= r.expected_output_len <= 15 for r in requests)
    assert not {t for r in requests for t in r.prompt} & set(tokenizer.all_special_ids)
    assert {t for r in requests for t in r.prompt} <= set(range(len(tokenizer)))
    assert random_requests(200, 40, 10, 0.5, pool, seed=3) == requests


def test_arrival_gaps_are_gamma_with_mean_one_over_rate_and_shape_burstiness(monkeypatch):
    gaps = []

    async def record(seconds):
        gaps.append(seconds)

    monkeypatch.setattr(serve_module.asyncio, "sleep", record)
    inputs = [RequestFuncInput("/v1/completions", MODEL, [5], 1, 1)] * 20001

    async def drain(rate, burstiness):
        gaps.clear()
        return [r async for r in serve_module.arrivals(inputs, rate, burstiness, seed=0)]

    for burstiness in (0.25, 1.0, 4.0):
        assert len(asyncio.run(drain(5.0, burstiness))) == len(inputs)
        # A gamma of shape k and scale 1/(rate k): mean 1/rate, coefficient of variation 1/sqrt(k).
        assert statistics.fmean(gaps) == pytest.approx(1 / 5.0, rel=0.05)
        assert statistics.pstdev(gaps) / statistics.fmean(gaps) == pytest.approx(1 / math.sqrt(burstiness), rel=0.06)
    asyncio.run(drain(math.inf, 1.0))
    assert gaps == []


# ---- metrics: vLLM's definitions on hand-made requests --------------------------------


def test_metrics_follow_vllms_definitions():
    outputs = [
        RequestFuncOutput(success=True, prompt_len=10, output_tokens=5, ttft=0.1, itl=[0.1, 0.2, 0.1, 0.1],
                          latency=0.6),
        RequestFuncOutput(success=True, prompt_len=20, output_tokens=1, ttft=0.2, itl=[], latency=0.2),
        RequestFuncOutput(success=True, prompt_len=30, output_tokens=3, ttft=0.2, itl=[0.4, 0.4], latency=1.0),
        RequestFuncOutput(success=False, prompt_len=40, error="HTTP 400"),
    ]
    m = calculate_metrics(outputs, duration=2.0, percentiles=[50, 99], goodput_slos={"ttft": 0.25, "tpot": 0.2})
    assert (m.completed, m.failed, m.total_input, m.total_output) == (3, 1, 60, 9)
    assert (m.request_throughput, m.output_throughput, m.total_token_throughput) == (1.5, 4.5, 34.5)
    # TPOT excludes the first token and one-token requests: (0.6-0.1)/4 and (1.0-0.2)/2.
    assert m.latencies["tpot"].mean_ms == pytest.approx((125 + 400) / 2)
    assert m.latencies["ttft"].median_ms == pytest.approx(200)
    assert m.latencies["itl"].mean_ms == pytest.approx(1000 * 1.3 / 6)
    assert m.latencies["e2el"].percentiles_ms[0] == (50, pytest.approx(600))
    # Goodput: request 1 passes (ttft 0.1, tpot 0.125); request 2 passes (tpot counts as 0);
    # request 3 fails (ttft 0.2 passes, tpot 0.4 does not).
    assert m.request_goodput == pytest.approx(2 / 2.0)


# ---- bench throughput ------------------------------------------------------------------


def test_bench_throughput_generates_exactly_the_requested_tokens_and_reports_them(folder, tmp_path, capsys):
    out = tmp_path / "throughput.json"
    code = main(["bench", "throughput", folder, "--num-prompts", "4", "--input-len", "12", "--output-len", "5",
                 "--num-kv-blocks", "64", "--output-json", str(out), "--disable-tqdm"])
    assert code == 0
    printed = capsys.readouterr().out
    match = re.search(r"Throughput: ([\d.]+) requests/s, ([\d.]+) total tokens/s, ([\d.]+) output tokens/s", printed)
    assert match and float(match[1]) > 0
    assert "Total num prompt tokens:  48" in printed and "Total num output tokens:  20" in printed
    assert re.search(r"Elapsed time: [\d.]+ s", printed)
    result = json.loads(out.read_text())
    # ignore_eos is on by default: every request generates exactly --output-len tokens.
    assert (result["num_requests"], result["total_prompt_tokens"], result["total_output_tokens"]) == (4, 48, 20)
    elapsed = result["elapsed_time"]
    assert result["requests_per_second"] == pytest.approx(4 / elapsed)
    assert result["output_tokens_per_second"] == pytest.approx(20 / elapsed)
    assert result["tokens_per_second"] == pytest.approx(68 / elapsed)
    assert result["config"] == {"num_prompts": 4, "input_len": 12, "output_len": 5, "range_ratio": 0.0, "seed": 0,
                                "ignore_eos": True, "temperature": 1.0}
    assert result["engine_args"]["model"] == folder


def test_bench_throughput_rejects_a_range_ratio_of_one(folder, capsys):
    assert main(["bench", "throughput", folder, "--num-prompts", "2", "--range-ratio", "1"]) == 2
    assert "range_ratio must be in [0, 1)" in capsys.readouterr().err


# ---- bench serve -----------------------------------------------------------------------


def _bench_serve(server, tmp_path, capsys, *flags) -> tuple[str, dict]:
    code = main(["bench", "serve", "--base-url", server.url, "--num-prompts", "8", "--random-input-len", "16",
                 "--random-output-len", "6", "--ignore-eos", "--save-result", "--result-dir", str(tmp_path),
                 "--result-filename", "result.json", *flags])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return captured.out, json.loads((tmp_path / "result.json").read_text())


def _assert_summary_matches_the_requests(result: dict) -> None:
    """The summary, recomputed from the per-request figures with vLLM's definitions."""
    ttfts, e2els, itls, outs = result["ttfts"], result["e2els"], result["itls"], result["output_lens"]
    for ttft, e2el, gaps in zip(ttfts, e2els, itls):
        assert 0 < ttft <= e2el
        assert ttft + sum(gaps) == pytest.approx(e2el)  # chunk gaps span first chunk → last chunk
    tpots = [(e - t) / (n - 1) for t, e, n in zip(ttfts, e2els, outs) if n > 1]
    assert result["mean_ttft_ms"] == pytest.approx(1000 * np.mean(ttfts))
    assert result["median_e2el_ms"] == pytest.approx(1000 * np.median(e2els))
    assert result["mean_tpot_ms"] == pytest.approx(1000 * np.mean(tpots))
    assert result["p99_itl_ms"] == pytest.approx(1000 * np.percentile([g for gaps in itls for g in gaps], 99))
    assert result["request_throughput"] == pytest.approx(result["completed"] / result["duration"])
    assert result["output_throughput"] == pytest.approx(sum(outs) / result["duration"])
    total_tokens = sum(outs) + sum(result["input_lens"])
    assert result["total_token_throughput"] == pytest.approx(total_tokens / result["duration"])


@pytest.mark.server
def test_bench_serve_completions_at_infinite_rate(server, tmp_path, capsys):
    printed, result = _bench_serve(server, tmp_path, capsys, "--endpoint", "/v1/completions",
                                   "--goodput", "ttft:2000", "tpot:300", "--percentile-metrics", "ttft,tpot,itl,e2el")
    lines = printed.splitlines()
    assert "Traffic request rate: inf" in lines and "Burstiness factor: 1.0 (Poisson process)" in lines
    start = lines.index("============ Serving Benchmark Result ============")
    table = lines[start:lines.index("=" * 50, start) + 1]
    assert table[1] == f"{'Successful requests:':<40} {8:<10}"
    for header in ("---------------Time to First Token----------------",
                   "-----Time per Output Token (excl. 1st token)------",
                   "---------------Inter-token Latency----------------",
                   "----------------End-to-end Latency----------------"):
        assert header in table
    for label in ("Benchmark duration (s):", "Total input tokens:", "Total generated tokens:",
                  "Request throughput (req/s):", "Request goodput (req/s):", "Output token throughput (tok/s):",
                  "Total Token throughput (tok/s):", "Mean TTFT (ms):", "Median TPOT (ms):", "P99 ITL (ms):",
                  "P99 E2EL (ms):"):
        assert any(line.startswith(label) for line in table), label
    assert lines[-1] == f"Results written to {tmp_path / 'result.json'}"
    assert (result["completed"], result["failed"], result["model_id"], result["endpoint"]) == \
        (8, 0, MODEL, "/v1/completions")
    # Token-id prompts: the server counts exactly the dataset's tokens; ignore_eos: exactly max_tokens out.
    assert result["input_lens"] == [16] * 8 and result["output_lens"] == [6] * 8
    assert [len(gaps) for gaps in result["itls"]] == [5] * 8  # a chunk per token, held-back text or not
    assert result["request_rate"] == "inf" and result["goodput"] == {"ttft": 2000.0, "tpot": 300.0}
    _assert_summary_matches_the_requests(result)
    good = sum(t <= 2.0 and (e - t) / (n - 1) <= 0.3
               for t, e, n in zip(result["ttfts"], result["e2els"], result["output_lens"]))
    assert result["request_goodput"] == pytest.approx(good / result["duration"])


@pytest.mark.server
def test_bench_serve_chat_at_a_bursty_finite_rate_with_a_concurrency_cap(server, tmp_path, capsys):
    printed, result = _bench_serve(server, tmp_path, capsys, "--endpoint", "/v1/chat/completions",
                                   "--request-rate", "20", "--burstiness", "0.5", "--max-concurrency", "3",
                                   "--disable-tqdm")
    assert "Burstiness factor: 0.5" in printed and "Maximum request concurrency: 3" in printed
    assert f"{'Request rate configured (RPS):':<40} {20.0:<10.2f}" in printed
    assert f"{'Maximum request concurrency:':<40} {3:<10}" in printed
    assert (result["completed"], result["endpoint"], result["max_concurrency"], result["burstiness"]) == \
        (8, "/v1/chat/completions", 3, 0.5)
    assert result["output_lens"] == [6] * 8
    # The chat template wraps each ~16-token text in a turn: the server counts more input tokens.
    assert all(n > 16 for n in result["input_lens"])
    assert all(text for text in result["generated_texts"])
    _assert_summary_matches_the_requests(result)


@pytest.mark.server
def test_server_vocabulary_decodes_as_the_models_tokenizer(server, folder):
    tokenizer = load_tokenizer(folder)
    with httpx.Client() as client:
        vocabulary = server_vocabulary(client, server.url, MODEL, seed=0)
        ids = vocabulary.token_pool[:40]
        assert vocabulary.decode(ids) == tokenizer.decode(ids)
        assert vocabulary.encode("Flat is better than nested.") == \
            tokenizer.encode("Flat is better than nested.", add_special_tokens=False)
    assert len(vocabulary.token_pool) > 100
    assert not set(vocabulary.token_pool) & set(tokenizer.all_special_ids)


def test_bench_serve_against_no_server_is_one_line_and_exit_1(capsys):
    code = main(["bench", "serve", "--base-url", f"http://127.0.0.1:{free_port()}", "--num-prompts", "2"])
    assert code == 1
    assert capsys.readouterr().err.startswith("error: cannot reach the server")


@pytest.mark.parametrize("flags, message", [
    (["--burstiness", "0"], "burstiness must be a positive number"),
    (["--request-rate", "0"], "request_rate must be positive"),
    (["--goodput", "latency:5"], "goodput takes NAME:MILLISECONDS"),
    (["--percentile-metrics", "ttft,speed"], "percentile_metrics must be"),
])
def test_bench_serve_rejects_bad_arguments_with_exit_2(flags, message, capsys):
    assert main(["bench", "serve", "--num-prompts", "2", *flags]) == 2
    assert message in capsys.readouterr().err


# ---- benchmarks/compare.py ---------------------------------------------------------------


def run_benchmark(script: str, *args: str) -> subprocess.CompletedProcess:
    """Run benchmarks/<script> in a fresh interpreter; it must succeed."""
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / script), *args],
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


@pytest.mark.slow
def test_compare_quick_runs_every_contender_and_prints_the_roofline():
    done = run_benchmark("compare.py", "--quick")
    out = done.stdout
    assert out.startswith("machine: ")
    # Where the CPU has no bf16 matmul instructions a bf16 model multiplies in fp32, and that rate bounds it.
    bf16 = ("bf16 computed in fp32 \\(no bf16 matmul instructions\\)"
            if computes_bf16_in_fp32(torch.device("cpu"), torch.bfloat16) else r"bf16 matmul [\d.]+ GFLOP/s")
    assert re.search(rf"measured here: fp32 matmul [\d.]+ GFLOP/s, {bf16}, memory copy [\d.]+ GB/s", out)
    assert re.search(r"tied embeddings: [\d.]+M parameters", out)
    for workload in ("workload A: 4 prompts", "workload B: 4 prompts"):
        assert workload in out
    for contender in ("transformers static", "transformers continuous", "tinyserve", "tinyserve traced",
                      "tinyserve bf16 KV", "transformers static bf16", "tinyserve bf16", "tinyserve bf16 traced"):
        # KV dtype, median, spread ("-": one round has none), best, output and total tok/s, the two ratios
        kv = "bf16" if "bf16" in contender else "f32"
        row = rf"^{contender} +{kv} +[\d.]+ +- +[\d.]+ +[\d.]+ +[\d.]+ +[\d.]+x +[\d.]+x$"
        assert len(re.findall(row, out, re.MULTILINE)) == 2
    assert out.count("roofline fp32: ") == 2 and out.count("roofline bf16: ") == 2
    assert len(re.findall(r"^tracing overhead \(traced / untraced, median of the per-round ratios\): "
                          r"fp32 [\d.]+, bf16 [\d.]+$", out, re.MULTILINE)) == 2
    # Greedy decoding of the same checkpoint: every contender generates the same tokens.
    assert out.count("transformers static 4/4, continuous 4/4, tinyserve traced 4/4 requests") == 2
    assert out.count("bf16: tinyserve bf16 / transformers static bf16 = ") == 2
    assert out.count("tinyserve bf16 traced equal to tinyserve bf16: 4/4") == 2
    assert len(re.findall(r"^a bf16 KV cache under fp32 weights: tinyserve bf16 KV / tinyserve = [\d.]+x \(medians\); "
                          r"greedy outputs equal to tinyserve's fp32: \d/4 requests$", out, re.MULTILINE)) == 2


# ---- benchmarks/tracing_cost.py ----------------------------------------------------------------


@pytest.mark.slow
def test_tracing_cost_quick_prints_the_cost_per_workload_and_dtype():
    done = run_benchmark("tracing_cost.py", "--quick")
    number = r"(-?[\d.]+)"
    rows = re.findall(rf"^([AB]) +(float32|bfloat16) +{number} +{number} +{number} +{number} +{number} +{number} "
                      rf"+{number} +{number}% +(\d+)/(\d+)$", done.stdout, re.MULTILINE)
    assert [(w, dtype) for w, dtype, *_ in rows] == [
        ("A", "float32"), ("B", "float32"), ("A", "bfloat16"), ("B", "bfloat16")]
    for _, _, total_off, total_on, loop_off, loop_on, rest_off, rest_on, ratio, lost, same, count in rows:
        assert float(loop_off) <= float(total_off) and float(loop_on) <= float(total_on)
        assert float(rest_on) > float(rest_off)  # building and exporting spans happens after the loop
        # The loss is computed from the ratio: printed to 3 and 1 decimals, the two must round consistently.
        low, high = ((1 - 1 / (float(ratio) + d)) * 100 for d in (-0.0005, 0.0005))
        assert low - 0.05 <= float(lost) <= high + 0.05
        assert same == count == "4"  # tracing never changes a token


# ---- benchmarks/stability.py ----------------------------------------------------------------


@pytest.mark.slow
def test_stability_quick_prints_each_run_with_its_probe_and_the_spreads():
    done = run_benchmark("stability.py", "--quick", "--runs", "2", "--contenders", "tinyserve")
    runs = re.findall(r"^run (\d): tinyserve +([\d.]+) tok/s, +\d+ minor faults, +\d+ involuntary switches, "
                      r"[\d.]+ CPU s / s, \d+ thread changes, probe (\d+) ms$", done.stdout, re.MULTILINE)
    assert [number for number, _, _ in runs] == ["1", "2"]
    speeds = [float(speed) for _, speed, _ in runs]
    summary = re.search(r"^tinyserve +(\d+), (\d+) +(\d+) +(\d+)% +(\d+)%$", done.stdout, re.MULTILINE)
    assert summary, done.stdout
    # Printed to different precisions: equal to within the last digit.
    assert all(abs(int(summary[i + 1]) - speed) <= 1 for i, speed in enumerate(speeds))
    assert abs(int(summary[4]) - 100 * (max(speeds) - min(speeds)) / (sum(speeds) / 2)) <= 1  # median of two
    probes = [int(probe) for _, _, probe in runs]
    assert re.search(rf"^machine probe: {min(probes)}-{max(probes)} ms over all runs \(spread \d+%\)$",
                     done.stdout, re.MULTILINE)
