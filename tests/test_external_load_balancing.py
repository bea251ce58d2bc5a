"""External load balancing: a real nginx in front of two --data-parallel-rank servers.

Two `tinyserve serve --data-parallel-size 2 --data-parallel-rank R` (R = 0 and 1), each
on its own port with --enable-server-load-tracking and --trace, and nginx started as a
process of its own from a config in the test's folder (`upstream { least_conn; }`), as
a router would stand in front of them. Requests go through nginx with the official
openai client; each rank's /metrics says what it served.
"""

import json
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from tests import shared_server
from tests.required_tools import system_binary
from tests.server_checks import metric, sse_lines, wait_until
from tinyserve.testing import NginxRouter, ServerProcess

pytestmark = pytest.mark.server

MODEL = shared_server.MODEL
REPORT = "endpoint-load-metrics"
ASK_FOR_REPORT = "endpoint-load-metrics-format"


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """The two rank servers, started together (each loads the model), traced into folders of their own."""
    model = shared_server.model_folder()
    flags = [(*shared_server.ENGINE_FLAGS, "--data-parallel-size", "2", "--data-parallel-rank", str(rank),
              "--enable-server-load-tracking", "--trace", "--trace-dir", str(tmp_path_factory.mktemp(f"rank{rank}")))
             for rank in (0, 1)]
    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(ServerProcess, model, *rank_flags) for rank_flags in flags]
    started = [future.result() for future in futures if future.exception() is None]
    failed = [future.exception() for future in futures if future.exception() is not None]
    if failed:
        for server in started:
            server.stop()
        raise failed[0]
    yield started
    for server in started:
        server.stop()


@pytest.fixture(scope="module")
def nginx(ranks, tmp_path_factory):
    """nginx on a free loopback port, least_conn over the two ranks; its URL."""
    router = NginxRouter(system_binary("nginx", "nginx"), [server.port for server in ranks],
                         tmp_path_factory.mktemp("nginx"))
    yield router.url
    router.stop()


def served(server) -> float:
    return metric(server.url, "request_success_total")


def test_nginx_spreads_the_requests_over_both_ranks_and_every_one_is_answered(ranks, nginx):
    client = openai.OpenAI(base_url=f"{nginx}/v1", api_key="unused", max_retries=0)
    before = [served(server) for server in ranks]

    def ask(i: int):
        return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": f"Request {i}"}],
                                              max_tokens=16, temperature=0)

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(ask, range(16)))
    assert [answer.choices[0].finish_reason in ("stop", "length") for answer in answers] == [True] * 16
    per_rank = [served(server) - count for server, count in zip(ranks, before)]
    assert sum(per_rank) == 16 and min(per_rank) > 0, per_rank


def test_each_rank_reports_its_own_engine_index_in_metrics_and_traces(ranks):
    for rank, server in enumerate(ranks):
        text = httpx.get(f"{server.url}/metrics", timeout=10).text
        engines = set(re.findall(r'engine="(\d+)"', text))
        assert engines == {str(rank)}
        [line] = [line for line in server.output().splitlines() if "tinyserve: tracing to " in line]
        run_dir = line.split("tinyserve: tracing to ")[1].strip()
        assert sorted(path.name for path in Path(run_dir).glob("engine-*.jsonl")) == [f"engine-{rank}.jsonl"]


def test_both_orca_report_formats_come_back_through_nginx(nginx):
    client = openai.OpenAI(base_url=f"{nginx}/v1", api_key="unused", max_retries=0)
    text = client.completions.with_raw_response.create(
        model=MODEL, prompt="Hello", max_tokens=4, temperature=0, extra_headers={ASK_FOR_REPORT: "text"})
    number = r"\d+\.\d+(?:e-\d+)?"
    assert re.fullmatch(rf"TEXT named_metrics\.kv_cache_usage_perc={number}, "
                        rf"named_metrics\.num_requests_waiting={number}", text.headers[REPORT])
    as_json = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "Hello"}], max_tokens=4, temperature=0,
        extra_headers={ASK_FOR_REPORT: "json"})
    kind, report = as_json.headers[REPORT].split(" ", 1)
    assert kind == "JSON"
    named = json.loads(report)["named_metrics"]
    assert set(named) == {"kv_cache_usage_perc", "num_requests_waiting"}
    assert all(isinstance(value, float) for value in named.values())


def test_no_report_unasked_for_an_unknown_format_or_on_a_stream(ranks):
    url = f"{ranks[0].url}/v1/completions"
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 4, "temperature": 0}
    assert REPORT not in httpx.post(url, json=body, timeout=60).headers
    assert REPORT not in httpx.post(url, json=body, headers={ASK_FOR_REPORT: "proto"}, timeout=60).headers
    streamed = httpx.post(url, json=body | {"stream": True}, headers={ASK_FOR_REPORT: "text"}, timeout=60)
    assert streamed.status_code == 200 and REPORT not in streamed.headers


def test_load_counts_a_generation_request_while_it_streams(ranks):
    server = ranks[0]

    def load() -> int:
        return httpx.get(f"{server.url}/load", timeout=10).json()["server_load"]

    wait_until(lambda: load() == 0, 30, "no request is in flight")
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 2000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as stream:
        lines = sse_lines(stream)  # kept: an iterator dropped half-read closes the stream
        assert next(lines).startswith("data: ")
        assert load() == 1
    wait_until(lambda: load() == 0, 30, "the dropped stream is no longer counted")


def test_load_is_zero_without_tracking(server):
    httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2}, timeout=60)
    assert httpx.get(f"{server.url}/load", timeout=10).json() == {"server_load": 0}
