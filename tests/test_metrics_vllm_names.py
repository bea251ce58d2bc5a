"""/metrics with --metrics-prefix vllm: vLLM's names and labels, and values that match what was sent.

One server of its own (the shared server's flags, plus the prefix). What it is sent: the same
long prompt twice (the second finds its leading blocks in the prefix cache, on by default),
a short one, a request to /v1/embeddings (400) and one to a path no route has (404).
"""

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests import shared_server
from tests.server_checks import wait_until
from tinyserve.testing import ServerProcess

pytestmark = pytest.mark.server

MODEL = shared_server.MODEL
PER_ENGINE = {"model_name", "engine"}
# vLLM's metrics (vllm/v1/metrics/loggers.py) that tinyserve exports: the type and the labels of each.
VLLM_METRICS = {
    "vllm:num_requests_running": ("gauge", PER_ENGINE),
    "vllm:num_requests_waiting": ("gauge", PER_ENGINE),
    "vllm:num_requests_waiting_by_reason": ("gauge", PER_ENGINE | {"reason"}),
    "vllm:kv_cache_usage_perc": ("gauge", PER_ENGINE),
    "vllm:prefix_cache_queries": ("counter", PER_ENGINE),
    "vllm:prefix_cache_hits": ("counter", PER_ENGINE),
    "vllm:num_preemptions": ("counter", PER_ENGINE),
    "vllm:mm_cache_queries": ("counter", PER_ENGINE),  # an image-text model's (tests/test_multimodal_server.py)
    "vllm:mm_cache_hits": ("counter", PER_ENGINE),
    "vllm:prompt_tokens": ("counter", PER_ENGINE),
    "vllm:prompt_tokens_cached": ("counter", PER_ENGINE),
    "vllm:generation_tokens": ("counter", PER_ENGINE),
    "vllm:request_success": ("counter", PER_ENGINE | {"finished_reason"}),
    "vllm:admission_rejections": ("counter", {"model_name", "reason"}),
    **{f"vllm:{name}": ("histogram", PER_ENGINE) for name in (
        "iteration_tokens_total", "request_prompt_tokens", "request_generation_tokens",
        "request_prefill_kv_computed_tokens", "request_num_preemptions", "request_params_n",
        "request_params_max_tokens", "request_max_num_generation_tokens", "time_to_first_token_seconds",
        "inter_token_latency_seconds", "request_time_per_output_token_seconds", "e2e_request_latency_seconds",
        "request_queue_time_seconds", "request_inference_time_seconds", "request_prefill_time_seconds",
        "request_decode_time_seconds")},
    # prometheus-fastapi-instrumentator's, which vLLM exports unprefixed.
    "http_requests": ("counter", {"method", "status", "handler"}),  # http_requests_total
    "http_request_duration_seconds": ("histogram", {"method", "handler"}),
    "http_request_duration_highr_seconds": ("histogram", set()),
}
# vLLM labels its cache_config_info with every field of its CacheConfig; tinyserve with those it has.
CACHE_CONFIG_LABELS = {"block_size", "enable_prefix_caching", "gpu_memory_utilization", "cache_dtype",
                       "num_gpu_blocks", "kv_cache_size_tokens", "kv_cache_max_concurrency", "engine"}
TINYSERVE_ONLY = {"vllm:server_errors"}  # 500s by path: no vLLM metric says as much


@pytest.fixture(scope="module")
def vllm_named():
    proc = ServerProcess(shared_server.model_folder(), *shared_server.FLAGS, "--metrics-prefix", "vllm")
    yield proc
    proc.stop()


def scrape(url: str) -> dict:
    """{family name: family}, as prometheus_client's parser reads the text (a counter's name without _total)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {family.name: family for family in text_string_to_metric_families(text)}


def value(families: dict, sample_name: str, **labels) -> float:
    """The sum of the samples called sample_name whose labels include `labels`."""
    return sum(sample.value for family in families.values() for sample in family.samples
               if sample.name == sample_name and labels.items() <= sample.labels.items())


def complete(url: str, prompt: str, max_tokens: int = 4) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()["usage"]


def test_vllm_names_labels_and_values(vllm_named):
    url = vllm_named.url
    long_prompt = " ".join(f"word{i}" for i in range(120))  # many 16-token blocks
    usages = [complete(url, long_prompt), complete(url, long_prompt), complete(url, "Hello there", 6)]
    cached = [usage["prompt_tokens_details"]["cached_tokens"] for usage in usages]
    assert cached[1] > 0, "the second copy of the long prompt found its blocks in the prefix cache"
    embeddings = httpx.post(f"{url}/v1/embeddings", json={"model": MODEL, "input": "hi"}, timeout=10)
    assert embeddings.status_code == 400
    assert httpx.get(f"{url}/no/such/path", timeout=10).status_code == 404
    n = len(usages)
    # The HTTP series are written once the last byte has gone out, just after the client has it.
    wait_until(lambda: value(scrape(url), "http_requests_total") == n + 2, 10, "every request was counted")
    families = scrape(url)

    exported = set(families)
    assert not {name for name in exported if name.startswith("tinyserve:")}
    for name, (kind, labels) in VLLM_METRICS.items():
        assert name in exported, name
        family = families[name]
        assert family.type == kind, name
        for sample in family.samples:
            assert set(sample.labels) - {"le"} == labels, (name, sample.labels)
    assert {s.labels["reason"] for s in families["vllm:num_requests_waiting_by_reason"].samples} == {
        "capacity", "deferred"}
    assert set(families["vllm:cache_config_info"].samples[0].labels) == CACHE_CONFIG_LABELS
    # vLLM's capacity: the pool's blocks over a whole context's (512 of 16 tokens over 4096 tokens: 2 requests)
    cache_config = families["vllm:cache_config_info"].samples[0].labels
    assert (cache_config["kv_cache_max_concurrency"], cache_config["kv_cache_size_tokens"]) == ("2.0", "8192")
    assert {s.labels["reason"]: s.value for s in families["vllm:admission_rejections"].samples
            if s.name.endswith("_total")} == {"max_num_queued_reqs": 0, "max_num_queued_tokens": 0}
    # prometheus-client writes each counter's and histogram's creation time as a gauge of its own, `..._created`.
    ours = {name for name in exported if name.startswith(("vllm:", "http_")) and not name.endswith("_created")}
    assert ours - set(VLLM_METRICS) - {"vllm:cache_config_info"} <= TINYSERVE_ONLY

    assert value(families, "vllm:prompt_tokens_cached_total") == sum(cached)
    assert value(families, "vllm:prefix_cache_hits_total") == sum(cached)
    assert value(families, "vllm:prompt_tokens_total") == sum(usage["prompt_tokens"] for usage in usages)
    assert value(families, "vllm:generation_tokens_total") == sum(usage["completion_tokens"] for usage in usages)
    assert value(families, "vllm:request_prefill_kv_computed_tokens_count") == n
    assert value(families, "vllm:request_prefill_kv_computed_tokens_sum") == sum(
        usage["prompt_tokens"] - hit for usage, hit in zip(usages, cached))
    assert value(families, "vllm:request_num_preemptions_count") == n
    assert value(families, "vllm:request_num_preemptions_sum") == 0
    assert value(families, "vllm:request_success_total", finished_reason="length") == n
    assert value(families, "vllm:num_requests_waiting_by_reason") == 0  # idle again
    assert value(families, "vllm:num_requests_running") == 0

    def http(**labels) -> float:
        return value(families, "http_requests_total", **labels)

    assert http(handler="/v1/completions", method="POST", status="2xx") == n
    assert http(handler="/v1/embeddings", method="POST", status="4xx") == 1
    assert http(handler="none", method="GET", status="4xx") == 1  # a path no route has: one series for all
    assert http(handler="/metrics") == 0 and http(handler="/health") == 0  # probes are not counted
    assert value(families, "http_request_duration_seconds_count", handler="/v1/completions", method="POST") == n
    assert value(families, "http_request_duration_highr_seconds_count") == n + 2


def test_embeddings_on_a_generative_model_is_a_400_that_says_why(server):
    response = httpx.post(f"{server.url}/v1/embeddings", json={"model": MODEL, "input": "hello"}, timeout=10)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == 400
    assert "does not support Embeddings API" in error["message"]
    assert "generative model" in error["message"] and "not a pooling (embedding) model" in error["message"]
