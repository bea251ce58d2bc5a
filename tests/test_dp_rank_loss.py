"""Losing one data-parallel rank fails only the requests it held.

A server with --data-parallel-size 2 runs six streams, spread over both engines by
the load balancer; kill -9 of engine 1's process ends the streams it held with the
engine-death error (a 503 error event) while engine 0's run to their last token, and
the log counts the lost requests truthfully. With --keep-alive-on-engine-death the
server goes on serving on engine 0 and /health stays 200, "degraded"; without it the
server drains engine 0's requests (as on SIGTERM) and then exits with status 1.
"""

import concurrent.futures
import contextlib
import json
import re
import signal
import threading
import time
from types import SimpleNamespace

import httpx
import psutil
import pytest

from tests.server_checks import is_token_chunk, long_context_model, sse_lines, wait_until
from tinyserve.frontend.dp_client import DPLoadBalancer
from tinyserve.testing import ServerProcess
from tinyserve.wire.messages import SchedulerStats

pytestmark = pytest.mark.server  # a real `tinyserve serve` on loopback

MODEL = "tiny"
STREAMS = 6
MAX_TOKENS = 2500  # far more than the looks below can run (50 of RUN_S, a few steps each), so no stream ends in them
RUN_S = 0.01  # how long the engines run between looks: a few steps, where a stream takes thousands
FLAGS = ("--served-model-name", MODEL, "--num-kv-blocks", "2048", "--data-parallel-size", "2")


def stream(url: str, i: int, sent: threading.Event, go: threading.Event) -> dict:
    """One streamed completion: its status, the tokens it reported, its finish reason or error message.
    `sent` is set once its response headers arrived (the server sends them once the request went to an
    engine); its body is read only once `go` is set (the server holds what the engine sends meanwhile).

    Six threads reading thousands of chunks a second (a chunk for every token) kept the test's main
    thread, which watches the engines, from the GIL for seconds."""
    body = {"model": MODEL, "prompt": f"story {i}", "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    outcome = {"status": None, "tokens": None, "finish_reason": None, "error": None}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as response:
        outcome["status"] = response.status_code
        sent.set()
        assert go.wait(timeout=300), "never told to read"
        lines = list(sse_lines(response))
    for line in lines:
        if not line.startswith("data: {") or is_token_chunk(line):
            continue
        chunk = json.loads(line.removeprefix("data: "))
        if "error" in chunk:
            outcome["error"] = chunk["error"]
        for choice in chunk.get("choices", ()):
            outcome["finish_reason"] = choice.get("finish_reason") or outcome["finish_reason"]
        if chunk.get("usage"):
            outcome["tokens"] = chunk["usage"]["completion_tokens"]
    return outcome


def by_engine(url: str) -> dict[str, dict[str, float]]:
    """Requests running, waiting and finished, each by engine, from one scrape of /metrics."""
    counts: dict[str, dict[str, float]] = {"running": {}, "waiting": {}, "finished": {}}
    names = {"num_requests_running": "running", "num_requests_waiting": "waiting",
             "request_success_total": "finished"}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        name = line.removeprefix("tinyserve:").split("{")[0]
        if line.startswith("tinyserve:") and name in names:
            engine = line.split('engine="')[1].split('"')[0]
            counts[names[name]][engine] = counts[names[name]].get(engine, 0) + float(line.rsplit(" ", 1)[1])
    return counts


def engine_process(proc: ServerProcess, index: int) -> psutil.Process:
    [engine] = [p for p in psutil.Process(proc.process.pid).children() if p.name() == f"tinyserve-engine-{index}"]
    return engine


def kill_engine_1_mid_stream(proc: ServerProcess) -> tuple[list[dict], float]:
    """Start STREAMS streams, SIGKILL engine 1 while every one of them is mid-stream; each stream's outcome,
    and how many engine 1 held at the kill.

    Both engines are stopped (SIGSTOP) until every request has been sent to one (started one by one, on a
    busy 2-core machine the first streams were thousands of tokens ahead before the last one's request
    reached the server), then run for moments of RUN_S (a stream needs hundreds of them) until the gauges,
    read while the engines are stopped and so no longer moving, show every stream held and none ended.
    The gauges lag the engines (the API process works through their outputs after them), so they are
    read only while the engines are stopped: then they count exactly what each engine holds."""
    sent, go = [threading.Event() for _ in range(STREAMS)], threading.Event()
    engines = [engine_process(proc, 0), engine_process(proc, 1)]
    seen = []

    def settled() -> dict:
        """The gauges, once two reads 0.3 s apart agree (the engines stopped, the API process caught up)."""
        previous = None
        while (now := by_engine(proc.url)) != previous:
            previous = now
            time.sleep(0.3)
        seen.append(now)
        return now

    def held(counts: dict) -> float:
        return sum(counts["running"].values()) + sum(counts["waiting"].values())

    with concurrent.futures.ThreadPoolExecutor(STREAMS) as pool:
        try:
            for engine in engines:
                engine.suspend()
            futures = [pool.submit(stream, proc.url, i, sent[i], go) for i in range(STREAMS)]
            wait_until(lambda: all(event.is_set() for event in sent), 60, "every request was sent to an engine")
            for _ in range(50):
                for engine in engines:
                    engine.resume()
                time.sleep(RUN_S)
                for engine in engines:
                    engine.suspend()
                counts = settled()
                if held(counts) == STREAMS or any(counts["finished"].values()):
                    break
            assert held(counts) == STREAMS and not any(counts["finished"].values()), counts
            on_engine_1 = counts["running"].get("1", 0) + counts["waiting"].get("1", 0)
            assert on_engine_1 >= 1, counts
            engines[1].send_signal(signal.SIGKILL)  # stopped: it dies all the same
        except AssertionError as error:
            raise AssertionError(f"{error}; by engine: {seen[-3:]}") from None
        finally:
            for engine in engines:
                with contextlib.suppress(psutil.NoSuchProcess):
                    engine.resume()
            go.set()
        return [future.result(timeout=180) for future in futures], on_engine_1


def check_only_the_dead_ranks_streams_failed(outcomes: list[dict], on_engine_1: float, output: str) -> None:
    failed = [o for o in outcomes if o["error"] is not None]
    finished = [o for o in outcomes if o["error"] is None]
    assert len(failed) == on_engine_1, (on_engine_1, outcomes)  # every stream was mid-stream at the kill
    for outcome in failed:
        assert outcome["status"] == 200 and outcome["error"]["code"] == 503, outcome
        assert "engine 1 died" in outcome["error"]["message"] and "killed by SIGKILL" in outcome["error"]["message"]
    for outcome in finished:  # engine 0's: every token
        assert outcome["tokens"] == MAX_TOKENS and outcome["finish_reason"] == "length", outcome
    # The log counts what was lost, and where: exactly the streams that failed.
    [lost] = re.findall(r"engine 1 died: .*?; (\d+) in-flight request\(s\) lost on it", output)
    assert int(lost) == len(failed), output[-3000:]


def test_the_load_balancer_never_chooses_a_dead_rank():
    balancer = DPLoadBalancer(3)
    balancer.on_stats(0, SchedulerStats(num_waiting_reqs=5))
    balancer.mark_dead(1)  # the least loaded, were it alive
    chosen = []
    for _ in range(4):
        chosen.append(balancer.choose_engine())
        balancer.on_request_sent(chosen[-1])
    assert 1 not in chosen and chosen[0] == 2, chosen
    balancer.mark_dead(0)
    balancer.mark_dead(2)
    with pytest.raises(RuntimeError, match="no live engine"):
        balancer.choose_engine()


def test_kept_alive_the_live_rank_finishes_its_streams_and_takes_every_new_request():
    proc = ServerProcess(long_context_model(), *FLAGS, "--keep-alive-on-engine-death")
    try:
        outcomes, on_engine_1 = kill_engine_1_mid_stream(proc)
        check_only_the_dead_ranks_streams_failed(outcomes, on_engine_1, proc.output())
        health = httpx.get(f"{proc.url}/health", timeout=10)
        assert health.status_code == 200, health.text
        assert health.json()["status"] == "degraded" and health.json()["live_engines"] == [0]
        assert "killed by SIGKILL" in health.json()["dead_engines"]["1"]
        for i in range(4):  # each would have gone to engine 1 now and then, were it chosen
            response = httpx.post(f"{proc.url}/v1/completions", timeout=60,
                                  json={"model": MODEL, "prompt": f"after {i}", "max_tokens": 4})
            assert response.status_code == 200, response.text
        assert proc.process.poll() is None, "the server exited although kept alive"
        gauges = [line for line in httpx.get(f"{proc.url}/metrics", timeout=10).text.splitlines()
                  if line.startswith(("tinyserve:num_requests_running{", "tinyserve:kv_cache_usage_perc{"))]
        assert gauges and all('engine="0"' in line for line in gauges), gauges  # the dead rank's are gone
    finally:
        output = proc.stop()
    assert proc.process.returncode == 0, output[-3000:]


def test_without_keep_alive_the_live_ranks_streams_finish_then_the_server_exits_1():
    proc = ServerProcess(long_context_model(), *FLAGS, "--shutdown-timeout", "120")
    try:
        outcomes, on_engine_1 = kill_engine_1_mid_stream(proc)
        proc.process.wait(60)
        wait_until(proc.group_is_gone, 10, "every process of the server is gone")
    finally:
        output = proc.stop()
    check_only_the_dead_ranks_streams_failed(outcomes, on_engine_1, output)
    assert proc.process.returncode == 1, output[-3000:]
    assert "an engine died: stopping the server once the requests on engine(s) [0] finish" in output


def test_a_request_for_a_rank_whose_connection_is_gone_goes_to_a_live_one_before_heartbeats_declare_it_dead():
    import asyncio

    from tinyserve.frontend.core_client import MPClient
    from tinyserve.frontend.engine_client import EngineDeadError

    balancer = DPLoadBalancer(3)
    balancer.on_stats(0, SchedulerStats(num_waiting_reqs=5))  # rank 1, the least loaded, has lost its node
    sent = []

    def send(index, kind, message):
        if index == 1:
            raise EngineDeadError("engine 1 is not connected")
        sent.append(index)

    client = SimpleNamespace(_check_alive=lambda: None, load_balancer=balancer, start_index=0, _send=send,
                             in_flight={}, data_parallel_size=3, client_index=0)
    request = SimpleNamespace(request_id="r")
    assert asyncio.run(MPClient.add_request(client, request)) == 2 and sent == [2]
    assert client.in_flight == {"r": 2} and balancer.dead == set()  # the heartbeats still decide its death
    balancer.mark_dead(0)
    balancer.mark_dead(2)  # no other engine: the request fails as before
    with pytest.raises(EngineDeadError, match="not connected"):
        asyncio.run(MPClient.add_request(client, SimpleNamespace(request_id="s")))
