"""Losing one data-parallel rank fails only the requests it held.

A server with --data-parallel-size 2 runs six streams, spread over both engines by
the load balancer; kill -9 of engine 1's process ends the streams it held with the
engine-death error (a 503 error event) while engine 0's run to their last token, and
the log counts the lost requests truthfully. With --keep-alive-on-engine-death the
server goes on serving on engine 0 and /health stays 200, "degraded"; without it the
server drains engine 0's requests (as on SIGTERM) and then exits with status 1.
"""

import concurrent.futures
import json
import re
import signal
import threading
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
MAX_TOKENS = 3000
KILL_BEFORE = MAX_TOKENS * 4 // 5  # the kill comes while every stream is short of this: hundreds of tokens to go
FLAGS = ("--served-model-name", MODEL, "--num-kv-blocks", "2048", "--data-parallel-size", "2")


def stream(url: str, i: int, sent: threading.Event, started: threading.Event, progress: list[int]) -> dict:
    """One streamed completion: its status, the tokens it reported, its finish reason or error message.
    `sent` is set once its response headers arrived (the server sends them once the request went to an
    engine), `started` once its first chunk arrived; progress[i] counts its chunks so far.

    While it runs, only the events in each network read are counted (an event cut in two by a read is
    missed: progress may fall a few short); the lines are parsed once it ended. Six threads going line by
    line through thousands of chunks a second (a chunk for every token) kept the test's main thread, which
    watches them, from the GIL until they were past KILL_BEFORE."""
    body = {"model": MODEL, "prompt": f"story {i}", "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    outcome = {"status": None, "tokens": None, "finish_reason": None, "error": None}
    pieces = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as response:
        outcome["status"] = response.status_code
        sent.set()
        for piece in response.iter_bytes():
            pieces.append(piece)
            progress[i] += piece.count(b"data: {")
            if progress[i]:
                started.set()
    whole = b"".join(pieces)
    for line in sse_lines(SimpleNamespace(iter_bytes=lambda: iter([whole]))):
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
    """Start STREAMS streams, SIGKILL engine 1 while every one of them is short of KILL_BEFORE and engine 1
    runs some; each stream's outcome, and how many engine 1 ran at the last look before the kill.

    Both engines are stopped (SIGSTOP) until every request has been sent to one, so that all begin
    decoding together: started one by one, on a busy 2-core machine the first streams were thousands
    of tokens ahead before the last one's request reached the server.
    Whether a stream reached an engine, and how far it got, is read on the client's side (its chunks),
    not from the engines' gauges, which lag: the tiny model decodes thousands of tokens a second, and a
    stream the gauges still showed running could be over by the kill."""
    sent, started = [threading.Event() for _ in range(STREAMS)], [threading.Event() for _ in range(STREAMS)]
    progress = [0] * STREAMS
    engines = [engine_process(proc, 0), engine_process(proc, 1)]
    with concurrent.futures.ThreadPoolExecutor(STREAMS) as pool:
        for engine in engines:
            engine.suspend()
        try:
            futures = [pool.submit(stream, proc.url, i, sent[i], started[i], progress) for i in range(STREAMS)]
            wait_until(lambda: all(event.is_set() for event in sent), 60, "every request was sent to an engine")
        finally:
            for engine in engines:
                engine.resume()
        seen = []

        def all_arrived_and_engine_1_runs() -> bool:
            if not all(event.is_set() for event in started):
                return False
            if max(progress) >= KILL_BEFORE:
                raise AssertionError(f"a stream passed {KILL_BEFORE} tokens before every stream had begun: {progress}")
            seen.append(by_engine(proc.url))
            return seen[-1]["running"].get("1", 0) > 0 and max(progress) < KILL_BEFORE

        try:
            wait_until(all_arrived_and_engine_1_runs, 60, "every stream reached an engine and engine 1 runs some")
        except AssertionError as error:
            ended = [future.result() for future in futures if future.done()]
            begun = sum(event.is_set() for event in started)
            raise AssertionError(f"{error}; {begun} streams had a token; by engine: {seen[-3:]}; "
                                 f"ended already: {ended}") from None
        on_engine_1 = seen[-1]["running"]["1"]
        engine_process(proc, 1).send_signal(signal.SIGKILL)
        return [future.result(timeout=180) for future in futures], on_engine_1


def check_only_the_dead_ranks_streams_failed(outcomes: list[dict], on_engine_1: float, output: str) -> None:
    failed = [o for o in outcomes if o["error"] is not None]
    finished = [o for o in outcomes if o["error"] is None]
    assert 1 <= len(failed) <= on_engine_1, (on_engine_1, outcomes)  # one may have finished since the last look
    for outcome in failed:
        assert outcome["status"] == 200 and outcome["error"]["code"] == 503, outcome
        assert "engine 1 died" in outcome["error"]["message"] and "killed by SIGKILL" in outcome["error"]["message"]
    for outcome in finished:  # engine 0's, and any of engine 1's done before the kill: every token
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
