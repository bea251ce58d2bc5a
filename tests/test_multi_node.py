"""Data parallel across nodes: a head (`--data-parallel-size-local` < size) and `--headless` nodes.

Two hosts are played by separate processes on loopback, and by two network
namespaces joined by a veth pair (the head in this one, the node in one created
here). The head answers /health only once every rank is ready, so each test
starts its headless node first: a node waits for its head.
"""

import concurrent.futures
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import httpx
import openai
import pytest

from tests.required_tools import missing, system_binary
from tests.server_checks import group_is_gone, long_context_model, sse_lines, wait_until
from tests.tiny_checkpoints import tiny_model_with_tokenizer
from tinyserve.lifecycle import schema
from tinyserve.testing import ServerProcess, free_port
from tinyserve.trace_reading.merge import merge_runs
from tinyserve.trace_reading.run import load_run

pytestmark = pytest.mark.server

MODEL = "tiny"
ENGINE_FLAGS = ("--served-model-name", MODEL, "--num-kv-blocks", "2048")


class HeadlessProcess:
    """`tinyserve serve MODEL --headless ...` (optionally inside a network namespace)."""

    def __init__(self, model, *flags: str, netns: tuple[str, str] | None = None) -> None:
        """netns: (ip's path, the namespace) to run the node in."""
        command = [sys.executable, "-m", "tinyserve.cli.main", "serve", str(model), "--headless", *ENGINE_FLAGS, *flags]
        if netns is not None:
            command = [netns[0], "netns", "exec", netns[1], *command]
        self.log = tempfile.TemporaryFile()
        self.process = subprocess.Popen(command, env=dict(os.environ, PYTHONUNBUFFERED="1"), stdout=self.log,
                                        stderr=subprocess.STDOUT, start_new_session=True)

    def output(self) -> str:
        return os.pread(self.log.fileno(), 1 << 22, 0).decode(errors="replace")

    def wait(self, timeout: float = 60) -> int:
        return self.process.wait(timeout)

    def kill(self) -> None:
        """SIGKILL the node's whole process group: the node and its engines, at once, as a machine lost."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()


def dp_flags(address: str, port: int, *, size: int = 2, local: int = 1) -> tuple[str, ...]:
    return ("--data-parallel-size", str(size), "--data-parallel-size-local", str(local),
            "--data-parallel-address", address, "--data-parallel-rpc-port", str(port))


def served_by_engine(url: str) -> dict[str, float]:
    """Finished requests per engine label, from the head's /metrics."""
    counts: dict[str, float] = {}
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith("tinyserve:request_success_total{"):
            engine = line.split('engine="')[1].split('"')[0]
            counts[engine] = counts.get(engine, 0) + float(line.rsplit(" ", 1)[1])
    return counts


def burst(url: str, count: int = 8, max_tokens: int = 8) -> list[str]:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)

    def one(i: int) -> str:
        return client.completions.create(model=MODEL, prompt=f"request {i} says hello", max_tokens=max_tokens).id

    with concurrent.futures.ThreadPoolExecutor(count) as pool:
        return list(pool.map(one, range(count)))


def stream_until_failure(url: str, outcome: dict) -> None:
    """Stream a long completion (of long_context_model); record when and how it ended."""
    body = {"model": MODEL, "prompt": "a long story", "max_tokens": 7000, "ignore_eos": True, "stream": True}
    outcome["text"] = ""
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
            for line in sse_lines(response):
                if "error" in line:
                    outcome["text"] += line
    except httpx.HTTPError as error:
        outcome["text"] += repr(error)
    outcome["ended"] = time.monotonic()


def test_a_burst_is_served_by_the_head_and_the_headless_node_and_one_trace_crosses_to_it(tmp_path):
    model = tiny_model_with_tokenizer("llama")
    port = free_port()
    node = HeadlessProcess(model, *dp_flags("127.0.0.1", port), "--data-parallel-start-rank", "1",
                           "--trace", "--trace-dir", str(tmp_path / "node"))
    head = ServerProcess(str(model), *ENGINE_FLAGS, *dp_flags("127.0.0.1", port),
                         "--trace", "--trace-dir", str(tmp_path / "head"))
    try:
        ids = burst(head.url, count=8)
        counts = served_by_engine(head.url)
        assert counts.get("0", 0) > 0 and counts.get("1", 0) > 0, counts
        assert sum(counts.values()) == 8
    finally:
        head.stop()
    assert node.wait(timeout=30) == 0, node.output()  # the head said it was stopping
    assert "the head is stopping" in node.output()

    [head_run] = (tmp_path / "head").iterdir()
    [node_run] = (tmp_path / "node").iterdir()
    assert sorted(p.name for p in node_run.glob("*.jsonl")) == ["engine-1.jsonl"]
    assert json.loads((node_run / "manifest.json").read_text())["node"]["headless"] is True
    run = load_run(merge_runs([head_run, node_run], tmp_path / "merged"))
    assert run.engine_indices == [0, 1]
    assert sorted(r.request_id for r in run.requests) == sorted(f"{i}-0" for i in ids)  # the engine request ids
    remote = [r for r in run.requests if r.sequences[0].engine_index == 1]
    assert remote, "no request of the burst went to the headless node"
    # One trace: the API's request span and the remote engine's spans share its trace id.
    trace_id = remote[0].trace_id
    services = {s.service for s in run.spans if s.trace_id == trace_id}
    assert {schema.SERVICE_API, schema.engine_service_name(1)} <= services
    engine_span = next(s for s in run.spans if s.trace_id == trace_id and s.service == schema.engine_service_name(1))
    assert engine_span.resource[schema.RESOURCE_DP_RANK] == 1
    assert engine_span.resource[schema.RESOURCE_TP_RANK] == 0
    assert engine_span.resource[schema.RESOURCE_HOST]
    assert remote[0].ttft_s is not None and remote[0].ttft_s > 0
    assert [n["ranks"] for n in run.manifest[schema.MANIFEST_NODES]] == [[0], [1]]


def test_a_node_with_another_model_or_a_taken_rank_is_refused_with_a_message_naming_both():
    model = tiny_model_with_tokenizer("llama")
    other = tiny_model_with_tokenizer("llama", num_hidden_layers=3)
    port = free_port()
    flags = (*dp_flags("127.0.0.1", port), "--data-parallel-start-rank", "1")
    started: list = []
    head_thread = threading.Thread(target=lambda: started.append(ServerProcess(str(model), *ENGINE_FLAGS,
                                                                               *dp_flags("127.0.0.1", port))))
    head_thread.start()
    try:
        wrong = HeadlessProcess(other, *flags)
        assert wrong.wait(timeout=120) == 1
        assert "serves a different model: fingerprint" in wrong.output() and "on the head" in wrong.output()
        good = HeadlessProcess(model, *flags)
        head_thread.join(timeout=120)
        [head] = started
        twice = HeadlessProcess(model, *flags)
        assert twice.wait(timeout=60) == 1
        message = twice.output()
        assert "rank 1 is served twice: by headless node" in message and f"pid {good.process.pid}" in message
        assert burst(head.url, count=2)  # the refusals changed nothing
    finally:
        head_thread.join(timeout=120)
        for head in started:
            head.stop()


def test_sigterm_to_a_head_still_waiting_for_its_headless_node_stops_it_and_its_engine_promptly():
    """A head waits for its nodes as long as start-up allows (minutes): SIGTERM ends the wait at once."""
    model = tiny_model_with_tokenizer("llama")
    rpc_port = free_port()
    command = [sys.executable, "-m", "tinyserve.cli.main", "serve", str(model), "--port", str(free_port()),
               *ENGINE_FLAGS, *dp_flags("127.0.0.1", rpc_port)]
    with tempfile.TemporaryFile() as log:
        head = subprocess.Popen(command, env=dict(os.environ, PYTHONUNBUFFERED="1"), stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            wait_until(lambda: head.poll() is None and accepts(rpc_port), 120,
                       "the head listens for its headless node")
            head.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            status = head.wait(60)
            stopped_after = time.monotonic() - signalled
            wait_until(lambda: group_is_gone(head.pid), 10, "no process of the head's group is left")
        finally:
            if head.poll() is None:
                os.killpg(head.pid, signal.SIGKILL)
                head.wait()
        output = os.pread(log.fileno(), 1 << 22, 0).decode(errors="replace")
    assert status == 0 and stopped_after < 20, (stopped_after, output[-3000:])
    assert "stopping during start-up" in output and "Traceback" not in output, output[-3000:]


def accepts(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False



def test_killing_the_headless_node_fails_its_requests_within_2_s_and_no_others():
    model = long_context_model()
    port = free_port()
    node = HeadlessProcess(model, *dp_flags("127.0.0.1", port), "--data-parallel-start-rank", "1")
    head = ServerProcess(str(model), *ENGINE_FLAGS, *dp_flags("127.0.0.1", port), "--keep-alive-on-engine-death",
                         "--shutdown-timeout", "0")
    outcomes = [{} for _ in range(4)]
    threads = [threading.Thread(target=stream_until_failure, args=(head.url, o)) for o in outcomes]
    try:
        for thread in threads:
            thread.start()
        wait_until(lambda: _running(head.url, "1") > 0 and _running(head.url, "0") + _running(head.url, "1") == 4,
                   30, "all four requests run, some on the headless node")
        on_node = int(_running(head.url, "1"))
        killed = time.monotonic()
        node.kill()
        # New requests before the heartbeats declare the node dead: one the balancer would give the node finds its
        # connection gone and goes to the head's engine instead of failing (a 503 "not connected" before).
        answers = []
        while sum("ended" in o for o in outcomes) < on_node and time.monotonic() - killed < 10:
            answers.append(httpx.post(f"{head.url}/v1/completions", timeout=60,
                                      json={"model": MODEL, "prompt": "after", "max_tokens": 2}))
        assert answers and not [a.text for a in answers if "not connected" in a.text], [a.text for a in answers]
        assert all(a.status_code == 200 or "engine 1 (on a headless node) died" in a.text for a in answers)
        wait_until(lambda: sum("ended" in o for o in outcomes) >= on_node, 10, "the node's requests end")
        ended = [o for o in outcomes if "ended" in o]
        assert len(ended) == on_node, outcomes  # the head's own requests go on
        assert max(o["ended"] for o in ended) - killed < 2.0, [o["ended"] - killed for o in ended]
        assert all("engine 1 (on a headless node) died" in o["text"] for o in ended), ended
        health = httpx.get(f"{head.url}/health")
        assert health.status_code == 200 and health.json()["status"] == "degraded", health.text
        assert "engine 1 (on a headless node) died" in health.json()["dead_engines"]["1"]
    finally:
        node.kill()
        head.stop()
        for thread in threads:
            thread.join(timeout=30)


def _running(url: str, engine: str) -> float:
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith("tinyserve:num_requests_running{") and f'engine="{engine}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


# ---- two network namespaces -----------------------------------------------------------


@pytest.fixture
def veth_namespace():
    """A network namespace `tsnode<pid>` joined to this one by a veth pair: 10.231.0.1 here, 10.231.0.2 there."""
    if os.geteuid() != 0:
        missing("network namespaces need root (CI runs as root)")
    ip = system_binary("ip", "iproute2")
    name = f"tsnode{os.getpid()}"
    here, there = f"tsh{os.getpid()}"[:15], f"tsn{os.getpid()}"[:15]
    commands = [
        [ip, "netns", "add", name],
        [ip, "link", "add", here, "type", "veth", "peer", "name", there],
        [ip, "link", "set", there, "netns", name],
        [ip, "addr", "add", "10.231.0.1/24", "dev", here],
        [ip, "link", "set", here, "up"],
        [ip, "netns", "exec", name, ip, "addr", "add", "10.231.0.2/24", "dev", there],
        [ip, "netns", "exec", name, ip, "link", "set", there, "up"],
        [ip, "netns", "exec", name, ip, "link", "set", "lo", "up"],
    ]
    try:
        for command in commands:
            subprocess.run(command, check=True, capture_output=True, text=True)
        yield name, here, ip
    except subprocess.CalledProcessError as error:
        pytest.fail(f"{' '.join(error.cmd)} failed: {error.stderr.strip()}")
    finally:
        subprocess.run([ip, "link", "del", here], capture_output=True)
        subprocess.run([ip, "netns", "del", name], capture_output=True)


def test_a_headless_node_in_another_network_namespace_serves_and_a_cut_link_is_a_missed_heartbeat(veth_namespace):
    namespace, link, ip = veth_namespace
    model = long_context_model()
    port = free_port()
    node = HeadlessProcess(model, *dp_flags("10.231.0.1", port), "--data-parallel-start-rank", "1",
                           netns=(ip, namespace))
    head = ServerProcess(str(model), *ENGINE_FLAGS, *dp_flags("10.231.0.1", port), "--keep-alive-on-engine-death",
                         "--shutdown-timeout", "0")
    outcomes = [{}, {}]
    threads = [threading.Thread(target=stream_until_failure, args=(head.url, o)) for o in outcomes]
    try:
        burst(head.url, count=8)
        counts = served_by_engine(head.url)
        assert counts.get("0", 0) > 0 and counts.get("1", 0) > 0, counts
        for thread in threads:
            thread.start()
        wait_until(lambda: _running(head.url, "0") > 0 and _running(head.url, "1") > 0, 30,
                   "a long request runs on each engine")
        cut = time.monotonic()
        subprocess.run([ip, "link", "set", link, "down"], check=True)  # no FIN, no RST: silence
        wait_until(lambda: any("ended" in o for o in outcomes), 10, "the node's request ends")
        [ended] = [o for o in outcomes if "ended" in o]  # the head's own goes on
        assert ended["ended"] - cut < 2.0
        assert "missed its heartbeats" in ended["text"], ended
        assert httpx.get(f"{head.url}/health").json()["status"] == "degraded"
    finally:
        head.stop()
        node.kill()
        for thread in threads:
            thread.join(timeout=30)
