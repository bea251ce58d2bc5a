"""A dead engine takes the server down with it, rather than leaving a server that answers 503 for ever.

kill -9 of the engine with four requests in flight (streamed and not, both
APIs), on a server with --trace: each request gets its error within a second,
the server exits with a non-zero status within five, nothing of it is left
running, and its trace files are whole. With --keep-alive-on-engine-death the
server stays up instead, and /metrics no longer shows the dead engine's gauges.
"""

import collections
import concurrent.futures
import json
import signal
import time

import httpx
import psutil
import pytest

from tests.server_checks import long_context_model, metric, sse_lines, wait_until
from tests.tiny_checkpoints import tiny_model_with_tokenizer
from tinyserve.lifecycle import schema
from tinyserve.testing import ServerProcess
from tinyserve.trace_reading.otlp_json import read_spans

pytestmark = pytest.mark.server  # a real `tinyserve serve` on loopback

MODEL = "tiny"
LONG_TOKENS = 6000  # far more than any machine generates before the kill
LONG = {"max_tokens": LONG_TOKENS, "ignore_eos": True}
REQUESTS = {  # name: (path, body, streamed)
    "chat_stream": ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "a"}], **LONG},
                    True),
    "completions_stream": ("/v1/completions", {"model": MODEL, "prompt": "b", **LONG}, True),
    "messages_stream": ("/v1/messages", {"model": MODEL, "max_tokens": LONG_TOKENS, "temperature": 0,
                                         "messages": [{"role": "user", "content": "e"}]}, True),
    "chat": ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "c"}], **LONG}, False),
}


def send(url: str, path: str, body: dict, streamed: bool) -> tuple[int, list[str], float]:
    """Status, lines (or the body) and when the answer ended."""
    if not streamed:
        response = httpx.post(f"{url}{path}", json=body, timeout=60)
        return response.status_code, [response.text], time.monotonic()
    with httpx.stream("POST", f"{url}{path}", json={**body, "stream": True}, timeout=60) as response:
        lines = [line for line in sse_lines(response) if line]
        return response.status_code, lines, time.monotonic()


def engine_of(proc: ServerProcess) -> psutil.Process:
    [engine] = [p for p in psutil.Process(proc.process.pid).children() if p.name() == "tinyserve-engine-0"]
    return engine


def start_four_requests(proc: ServerProcess, pool) -> dict:
    futures = {name: pool.submit(send, proc.url, path, body, streamed)
               for name, (path, body, streamed) in REQUESTS.items()}
    wait_until(lambda: metric(proc.url, "num_requests_running") == 4
               and metric(proc.url, "generation_tokens_total") > 20, 60, "all four requests are generating")
    return futures


@pytest.fixture(scope="module")
def killed_run(tmp_path_factory):
    trace_dir = tmp_path_factory.mktemp("traces")
    proc = ServerProcess(long_context_model(), "--served-model-name", MODEL, "--num-kv-blocks", "2048",
                         "--trace", "--trace-dir", str(trace_dir))
    try:
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            futures = start_four_requests(proc, pool)
            engine_of(proc).send_signal(signal.SIGKILL)
            killed_at = time.monotonic()
            results = {name: future.result(timeout=30) for name, future in futures.items()}
        proc.process.wait(30)
        exited_after = time.monotonic() - killed_at
        wait_until(proc.group_is_gone, 5, "every process of the server is gone")
    finally:
        output = proc.stop()
    [run] = list(trace_dir.iterdir())
    return {"results": results, "killed_at": killed_at, "exited_after": exited_after,
            "returncode": proc.process.returncode, "run": run, "output": output}


def test_every_request_in_flight_gets_its_error_within_a_second(killed_run):
    for name, (status, lines, ended) in killed_run["results"].items():
        assert ended - killed_run["killed_at"] < 1.0, name
    for name in ("chat_stream", "completions_stream"):
        status, lines, _ = killed_run["results"][name]
        assert status == 200 and lines[-1] == "data: [DONE]"
        assert json.loads(lines[-2].removeprefix("data: "))["error"]["code"] == 503
    status, lines, _ = killed_run["results"]["messages_stream"]
    assert status == 200 and lines[-2] == "event: error"
    status, [text], _ = killed_run["results"]["chat"]
    assert status == 503 and "engine" in json.loads(text)["error"]["message"]


def test_the_server_exits_non_zero_within_five_seconds_leaving_nothing_running(killed_run):
    assert killed_run["returncode"] == 1, killed_run["output"][-3000:]
    assert killed_run["exited_after"] < 5.0, killed_run["output"][-3000:]
    assert "an engine died: stopping the server" in killed_run["output"]


def test_the_trace_files_are_whole(killed_run):
    run = killed_run["run"]
    for path in run.glob("*.jsonl"):
        for line in path.read_text().splitlines():
            json.loads(line)
    spans = [span for span in read_spans(run / schema.API_TRACE_FILE)]
    traces = collections.defaultdict(list)
    for span in spans:
        traces[span.trace_id].append(span)
    roots = [s for ss in traces.values() for s in ss if s.parent_span_id not in {t.span_id for t in ss}]
    assert sorted(root.name for root in roots) == sorted(f"POST {path}" for path, _, _ in REQUESTS.values())
    request_spans = [s for s in spans if s.name.startswith(("chat ", "text_completion "))]
    assert len(request_spans) == 4


def test_kept_alive_the_server_answers_503_and_shows_no_gauge_of_the_dead_engine():
    proc = ServerProcess(str(tiny_model_with_tokenizer("llama")), "--served-model-name", MODEL,
                         "--num-kv-blocks", "64", "--keep-alive-on-engine-death")
    try:
        assert "tinyserve:kv_cache_usage_perc{" in httpx.get(f"{proc.url}/metrics").text
        engine_of(proc).send_signal(signal.SIGKILL)
        wait_until(lambda: httpx.get(f"{proc.url}/health").status_code == 503, 5, "/health turns 503")
        health = httpx.get(f"{proc.url}/health").json()
        assert health["status"] == "unavailable"
        assert health["reason"].startswith("an engine died: engine 0 died: process ") and "killed by SIGKILL" in health["reason"]
        time.sleep(1.0)  # more than the shutdown would need to begin
        assert proc.process.poll() is None, "the server exited although kept alive"
        text = httpx.get(f"{proc.url}/metrics").text
        for gauge in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
            assert f"tinyserve:{gauge}{{" not in text, gauge
    finally:
        proc.stop()
    assert proc.group_is_gone()
