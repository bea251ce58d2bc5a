"""/metrics: vLLM's metrics with vLLM's definitions and buckets, as a real Prometheus server scrapes them."""

import math
import re
import subprocess
import time

import httpx
import openai
import pytest

from tests import shared_server
from tests.required_tools import system_binary
from tests.server_checks import wait_until
from tinyserve.testing import ServerProcess, free_port

pytestmark = pytest.mark.server

MODEL = shared_server.MODEL


def series(url: str, name: str, **labels) -> float:
    """The sum of tinyserve:<name> over the label sets that carry `labels`."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    total = 0.0
    for match in re.finditer(rf"^tinyserve:{re.escape(name)}\{{(.*)\}} (\S+)$", text, re.MULTILINE):
        if all(f'{key}="{value}"' in match.group(1) for key, value in labels.items()):
            total += float(match.group(2))
    return total


def bucket_bounds(url: str, name: str) -> list[float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    bounds = re.findall(rf'^tinyserve:{re.escape(name)}_bucket\{{[^}}]*le="([^"]+)"[^}}]*\}}', text, re.MULTILINE)
    return [float(b) for b in dict.fromkeys(bounds)]  # one label set's bounds, in order


def generate_text(server, prompt: str, max_tokens: int) -> str:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    return httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]


def test_a_request_ending_on_a_stop_string_is_counted_as_stopped_not_aborted(server):
    prompt = "Errors should never pass silently"
    text = generate_text(server, prompt, 24)
    stop = text[6:9]
    assert stop.strip()
    before = {reason: series(server.url, "request_success_total", finished_reason=reason)
              for reason in ("stop", "abort", "length")}
    queued_before = series(server.url, "request_queue_time_seconds_count")
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True, "stop": [stop]}
    choice = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()["choices"][0]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", stop)
    # The engine's timestamps come with its answer to the abort, which follows the response.
    wait_until(lambda: series(server.url, "request_queue_time_seconds_count") == queued_before + 1, 10,
               "the engine's timestamps of the stopped request were observed")
    after = {reason: series(server.url, "request_success_total", finished_reason=reason) for reason in before}
    assert {reason: after[reason] - before[reason] for reason in before} == {"stop": 1, "abort": 0, "length": 0}


def test_per_request_histograms_count_each_sample_and_each_parent_once(server):
    names = ("request_params_n", "request_params_max_tokens", "request_prompt_tokens", "request_generation_tokens",
             "request_max_num_generation_tokens", "request_inference_time_seconds")
    snapshot = lambda: {f"{name}_{part}": series(server.url, f"{name}_{part}")  # noqa: E731
                        for name in names for part in ("count", "sum")}
    iteration_before = series(server.url, "iteration_tokens_total_sum")
    before = snapshot()
    prompt = "Simple is better than complex"
    num_prompt = len(httpx.post(f"{server.url}/tokenize", json={"model": MODEL, "prompt": prompt}).json()["tokens"])
    body = {"model": MODEL, "prompt": prompt, "n": 2, "max_tokens": 5, "temperature": 1, "seed": 3, "ignore_eos": True}
    assert httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).status_code == 200
    after = snapshot()
    added = {name: after[name] - before[name] for name in after}
    assert added.pop("request_inference_time_seconds_sum") > 0
    assert added == {
        "request_params_n_count": 1, "request_params_n_sum": 2,
        "request_params_max_tokens_count": 2, "request_params_max_tokens_sum": 10,
        "request_prompt_tokens_count": 2, "request_prompt_tokens_sum": 2 * num_prompt,
        "request_generation_tokens_count": 2, "request_generation_tokens_sum": 10,
        "request_max_num_generation_tokens_count": 1, "request_max_num_generation_tokens_sum": 5,
        "request_inference_time_seconds_count": 2,
    }
    # Every step's tokens: each sample's prompt when it reaches its first token, and each generated token.
    assert series(server.url, "iteration_tokens_total_sum") - iteration_before == 2 * num_prompt + 10


def test_histograms_have_vllms_buckets(server):
    generate_text(server, "Now is better than never", 2)  # every histogram has a series
    ttft = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
            80.0, 160.0, 640.0, 2560.0]
    token_latency = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                     40.0, 80.0]
    request_latency = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                       240.0, 480.0, 960.0, 1920.0, 7680.0]
    # Token counts: 1, 2, 5, 10, ... up to max_model_len.
    tokens = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000]
    assert shared_server.MAX_MODEL_LEN < 5000
    expected = {
        "time_to_first_token_seconds": ttft,
        "inter_token_latency_seconds": token_latency,
        "request_time_per_output_token_seconds": token_latency,
        "e2e_request_latency_seconds": request_latency,
        "request_queue_time_seconds": request_latency,
        "request_inference_time_seconds": request_latency,
        "iteration_tokens_total": [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384],
        "request_params_n": [1, 2, 5, 10, 20],
        "request_prompt_tokens": tokens,
        "request_params_max_tokens": tokens,
    }
    for name, bounds in expected.items():
        assert bucket_bounds(server.url, name) == [*bounds, math.inf], name


def test_cache_config_info_and_process_metrics_are_exported(server):
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    [labels] = re.findall(r"^tinyserve:cache_config_info\{(.*)\} 1\.0$", text, re.MULTILINE)
    flags = dict(zip(shared_server.ENGINE_FLAGS[::2], shared_server.ENGINE_FLAGS[1::2]))
    assert f'num_gpu_blocks="{flags["--num-kv-blocks"]}"' in labels
    assert 'block_size="16"' in labels and 'enable_prefix_caching="True"' in labels and 'engine="0"' in labels
    resident = re.search(r"^process_resident_memory_bytes (\S+)$", text, re.MULTILINE)
    assert resident is not None and float(resident.group(1)) > 10e6  # a Python process with torch loaded
    assert re.search(r"^process_cpu_seconds_total \S+$", text, re.MULTILINE)


# ---- a real Prometheus ------------------------------------------------------------


@pytest.fixture
def prometheus(tmp_path):
    """Start Prometheus on loopback; the test writes its scrape target with `scrape(url)`."""
    binary = system_binary("prometheus", "prometheus")
    port = free_port()
    processes = []

    def scrape(target: str) -> str:
        config = tmp_path / "prometheus.yml"
        config.write_text("global:\n  scrape_interval: 1s\nscrape_configs:\n  - job_name: tinyserve\n"
                          f"    static_configs:\n      - targets: ['{target}']\n")
        log = open(tmp_path / "prometheus.log", "wb")
        processes.append(subprocess.Popen(
            [binary, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'data'}",
             f"--web.listen-address=127.0.0.1:{port}"], stdout=log, stderr=subprocess.STDOUT))
        url = f"http://127.0.0.1:{port}"

        def ready() -> bool:
            assert processes[0].poll() is None, (tmp_path / "prometheus.log").read_text()[-3000:]
            try:
                return httpx.get(f"{url}/-/ready", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(ready, 60, "Prometheus is ready")
        return url

    yield scrape
    for process in processes:
        process.terminate()
        process.wait(30)


def test_prometheus_scrapes_the_server_and_answers_a_ttft_quantile(prometheus):
    server = ServerProcess(shared_server.model_folder(), "--served-model-name", MODEL)
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        slowest = 0.0  # the client's time to its first chunk is at least the server's TTFT
        for i in range(6):
            started = time.monotonic()
            stream = client.completions.create(model=MODEL, prompt=f"Request {i}: beautiful is better than ugly",
                                               max_tokens=3, temperature=0, stream=True)
            for _ in stream:
                slowest = max(slowest, time.monotonic() - started)
                break
            for _ in stream:
                pass
        url = prometheus(f"127.0.0.1:{server.port}")
        query = "histogram_quantile(0.9, sum by (le) (tinyserve:time_to_first_token_seconds_bucket))"

        def answer():
            response = httpx.get(f"{url}/api/v1/query", params={"query": query}, timeout=10).json()
            assert response["status"] == "success", response
            return response["data"]["result"]

        count_query = "sum(tinyserve:time_to_first_token_seconds_count)"
        wait_until(lambda: [r["value"][1] for r in httpx.get(f"{url}/api/v1/query", params={"query": count_query},
                                                             timeout=10).json()["data"]["result"]] == ["6"],
                   60, "Prometheus has scraped all six first tokens")
        [result] = answer()
        quantile = float(result["value"][1])
        # Prometheus interpolates within the bucket holding the 90th percentile: above 0, and no
        # further than the upper bound of the bucket that holds the slowest first token.
        bounds = [b for b in bucket_bounds(server.url, "time_to_first_token_seconds") if b >= slowest]
        assert 0 < quantile <= bounds[0]
    finally:
        server.stop()
