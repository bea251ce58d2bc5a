"""Several API processes on one port: `tinyserve serve --api-server-count N` (vLLM's flag, `-asc`).

With `--api-server-count 2 --data-parallel-size 2 --trace`, a burst of concurrent greedy
requests is answered with transformers' tokens by both engines, and `/metrics` (vLLM's
names, whichever process answers) counts every request exactly once. Streams held by
both API processes (which process holds a connection is read from the operating system)
run to their end when the server gets SIGTERM, which then exits 0 leaving nothing behind,
and each stream's request spans are in the trace file of the process that held it; measured
in every process, that server runs each entry of the reading path's section on several API processes.
An API process killed outright takes the server down with exit status 1. How an engine
sends each output to the API process that sent its request is tested without a process.
"""

import concurrent.futures
import json
import re
import signal
import time

import httpx
import psutil
import pytest

from tests.patience import patient
from tests.reading_path_entries import LineCoverage, never_ran, sections
from tests.server_checks import is_token_chunk, sse_lines, wait_until
from tests.shared_server import ENGINE_FLAGS, MODEL, model_folder
from tinyserve.cli.main import main
from tinyserve.engine.client_outputs import ClientOutputs
from tinyserve.lifecycle import schema
from tinyserve.sampling_params import SamplingParams
from tinyserve.testing import ServerProcess
from tinyserve.trace_reading.run import load_run
from tinyserve.wire.messages import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, SchedulerStats

BURST_PROMPTS = [[9, 120, 33, 41, 7], [250, 3, 18, 77, 140, 201, 9], [5, 6, 7, 8], [100, 200, 300]] * 4
STREAM_TOKENS = 2000  # seconds of decoding: the streams are still running when SIGTERM comes (at 1000, on two
# busy cores, the first stream opened had ended 0.2 s before SIGTERM, while the last ones were opened)
STREAMS_AT_ONCE, MAX_STREAMS = 4, 12  # opened four at a time until both API processes hold one
READING_PATH_SECTION = "Several API processes on one port (`--api-server-count N`)"  # docs/reading_path.md's
KILL_STREAM_TOKENS = 1500  # more steps than the 1000 messages a dead API process's socket queues


def api_processes(server: ServerProcess) -> dict[int, psutil.Process]:
    """The server's API processes by index (their process titles: tinyserve-api-<i>)."""
    found = {}
    for child in psutil.Process(server.process.pid).children():
        if child.name().startswith("tinyserve-api-"):
            found[int(child.name().rsplit("-", 1)[1])] = child
    return found


def holder(processes: dict[int, psutil.Process], client_port: int) -> int | None:
    """The index of the API process whose socket is connected to this client port."""
    for index, process in processes.items():
        if any(c.raddr and c.raddr.port == client_port for c in process.net_connections(kind="tcp")):
            return index
    return None


def vllm_metric(text: str, name: str) -> dict[str, float]:
    """vllm:<name>, summed over its label sets, by engine."""
    by_engine: dict[str, float] = {}
    for match in re.finditer(rf'^vllm:{name}\{{([^}}]*)\}} (\S+)$', text, re.MULTILINE):
        engine = re.search(r'engine="(\d+)"', match.group(1)).group(1)
        by_engine[engine] = by_engine.get(engine, 0.0) + float(match.group(2))
    return by_engine


def greedy_token_ids(url: str, prompt: list[int]) -> list[int]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 16, "temperature": 0.0, "logprobs": 0,
            "return_tokens_as_token_ids": True}
    answer = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert answer.status_code == 200, answer.text
    return [int(t.removeprefix("token_id:")) for t in answer.json()["choices"][0]["logprobs"]["tokens"]]


class Stream:
    """One streamed completion on a connection of its own, read in a thread to its end."""

    def __init__(self, url: str, pool: concurrent.futures.Executor, processes: dict[int, psutil.Process],
                 max_tokens: int = STREAM_TOKENS) -> None:
        self.client = httpx.Client(timeout=120)
        body = {"model": MODEL, "prompt": "a story", "max_tokens": max_tokens, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}
        self.response = self.client.send(self.client.build_request("POST", f"{url}/v1/completions", json=body),
                                         stream=True)
        self.lines = sse_lines(self.response)
        self.first = json.loads(next(line for line in self.lines if line.startswith("data: {"))[6:])
        # Which process holds the connection, asked before the rest is read: a stream read to its
        # end closes its connection, and a fast server ends a stream within a busy test's moment.
        client_port = self.response.extensions["network_stream"].get_extra_info("socket").getsockname()[1]
        self.holder = holder(processes, client_port)
        self.outcome = pool.submit(self._rest)

    def _rest(self) -> dict:
        finish, tokens = None, None
        try:
            for line in self.lines:
                if line.startswith("data: {") and not is_token_chunk(line):  # only the stream's last chunks
                    chunk = json.loads(line[6:])
                    for choice in chunk.get("choices", ()):
                        finish = choice.get("finish_reason") or finish
                    if chunk.get("usage"):
                        tokens = chunk["usage"]["completion_tokens"]
        except httpx.HTTPError:  # the process that held the connection is gone
            return {"finish_reason": None, "tokens": None, "broken": True}
        finally:
            self.client.close()
        return {"finish_reason": finish, "tokens": tokens}


def open_streams_on_both(url: str, processes: dict, pool, opener, max_tokens: int) -> tuple[list[Stream], dict]:
    """Streams opened a few at a time until both API processes hold one; and which holds each (by response id)."""
    streams, held = [], {}
    while set(held.values()) != {0, 1}:
        assert len(streams) < MAX_STREAMS, f"{MAX_STREAMS} streams, all on API process {set(held.values())}"
        batch = list(opener.map(lambda _: Stream(url, pool, processes, max_tokens), range(STREAMS_AT_ONCE)))
        for stream in batch:
            held[stream.first["id"]] = stream.holder
            assert stream.holder is not None, "no API process holds the stream's connection"
        streams += batch
    return streams, held


@pytest.mark.server
def test_two_api_processes_over_two_engines_answer_count_drain_and_trace(tmp_path):
    from tests.hf_reference import hf_greedy

    folder, trace_dir = model_folder(), tmp_path / "traces"
    measured = LineCoverage(tmp_path)  # every process's lines: the reading path's section on several API processes
    server = ServerProcess(folder, *ENGINE_FLAGS, "--api-server-count", "2", "--data-parallel-size", "2",
                           "--metrics-prefix", "vllm", "--trace", "--trace-dir", str(trace_dir),
                           "--shutdown-timeout", "300", env=measured.env)
    try:
        with concurrent.futures.ThreadPoolExecutor(len(BURST_PROMPTS)) as pool:
            got = list(pool.map(lambda p: greedy_token_ids(server.url, p), BURST_PROMPTS))
        expected = {tuple(p): hf_greedy(folder, p) for p in BURST_PROMPTS}
        assert got == [expected[tuple(p)] for p in BURST_PROMPTS]
        text = httpx.get(f"{server.url}/metrics", timeout=10).text
        finished = vllm_metric(text, "request_success_total")
        assert sum(finished.values()) == len(BURST_PROMPTS)  # each once, over both processes' files
        assert set(finished) == {"0", "1"} and min(finished.values()) > 0  # both engines served
        assert sum(vllm_metric(text, "generation_tokens_total").values()) == sum(map(len, got))
        assert "process_cpu_seconds_total" not in text  # one process's figure would pass for the server's

        processes = api_processes(server)
        assert sorted(processes) == [0, 1]
        with concurrent.futures.ThreadPoolExecutor(MAX_STREAMS) as pool, \
                concurrent.futures.ThreadPoolExecutor(STREAMS_AT_ONCE) as opener:
            streams, held = open_streams_on_both(server.url, processes, pool, opener, STREAM_TOKENS)
            sigterm_ns = time.time_ns()
            server.process.send_signal(signal.SIGTERM)
            outcomes = [stream.outcome.result() for stream in streams]
        assert outcomes == [{"finish_reason": "length", "tokens": STREAM_TOKENS}] * len(streams)
        assert server.process.wait(patient(30)) == 0
        wait_until(server.group_is_gone, 30, "every process of the server is gone")
    finally:
        server.stop()
    assert never_ran(sections()[READING_PATH_SECTION], measured.executed()) == []
    [run_dir] = trace_dir.iterdir()
    assert {p.name for p in run_dir.glob("api-*.jsonl")} == {schema.api_trace_file(0), schema.api_trace_file(1)}
    run = load_run(run_dir)
    for request_id, index in held.items():
        request = run.request(request_id)
        assert request.service == schema.api_service_name(index)
        assert request.request_span.end_ns > sigterm_ns  # it was in flight at SIGTERM, and drained
    assert len(run.requests) == len(BURST_PROMPTS) + len(streams)


@pytest.mark.server
def test_an_api_process_killed_takes_the_server_down_with_status_1_once_the_others_drain():
    """The streams of the API process left run to their end: more engine steps than a socket's queue
    (ZeroMQ's 1000 messages) to the dead one holds, which must not stall the engine's other outputs."""
    server = ServerProcess(model_folder(), *ENGINE_FLAGS, "-asc", "2", "--shutdown-timeout", "300")
    try:
        processes = api_processes(server)
        assert sorted(processes) == [0, 1]
        with concurrent.futures.ThreadPoolExecutor(MAX_STREAMS) as pool, \
                concurrent.futures.ThreadPoolExecutor(STREAMS_AT_ONCE) as opener:
            streams, held = open_streams_on_both(server.url, processes, pool, opener, KILL_STREAM_TOKENS)
            processes[1].kill()
            outcomes = {stream.first["id"]: stream.outcome.result() for stream in streams}
        for request_id, index in held.items():
            expected = {"finish_reason": "length", "tokens": KILL_STREAM_TOKENS} if index == 0 else \
                {"finish_reason": None, "tokens": None, "broken": True}
            assert outcomes[request_id] == expected
        assert server.process.wait(patient(30)) == 1
        wait_until(server.group_is_gone, 30, "every process of the server is gone")
        assert f"API process 1 (pid {processes[1].pid}) exited" in server.output()
    finally:
        server.stop()


def test_an_engine_sends_each_output_to_the_api_process_that_sent_its_request():
    clients = ClientOutputs(num_clients=2)
    for request_id, client in (("a", 0), ("b", 1), ("c", 0)):
        assert clients.knows(EngineCoreRequest(request_id, [1], SamplingParams(), [], 0.0, client_index=client))
    assert not clients.knows(EngineCoreRequest("d", [1], SamplingParams(), [], 0.0, client_index=2))
    stats = SchedulerStats(num_running_reqs=3)
    step = EngineCoreOutputs(engine_index=1, outputs=[EngineCoreOutput("a", [5]), EngineCoreOutput("b", [6]),
                                                      EngineCoreOutput("c", [7], finish_reason="length")],
                             scheduler_stats=stats)
    shares = clients.split(step)
    assert [(i, [o.request_id for o in m.outputs]) for i, m in shares] == [(0, ["a", "c"]), (1, ["b"])]
    assert all(m.scheduler_stats == stats and m.engine_index == 1 for _, m in shares)  # every one reads the load
    assert clients.client_of == {"a": 0, "b": 1}  # a finished request is forgotten
    lone = ClientOutputs(num_clients=1)
    assert lone.split(step) == [(0, step)]  # one API process: the step's message as it was


@pytest.mark.parametrize("flags, problem", [
    (["--api-server-count", "0"], "--api-server-count must be at least 1"),
    (["-asc", "2", "--headless", "--data-parallel-size", "2", "--data-parallel-size-local", "1",
      "--data-parallel-start-rank", "1"], "a --headless node serves none"),
    (["-asc", "2", "--data-parallel-size", "2", "--data-parallel-rank", "1"], "not one --data-parallel-rank"),
])
def test_api_server_count_flags_that_cannot_work_are_exit_2_naming_them(flags, problem, capsys):
    assert main(["serve", "--port", "0", *flags]) == 2
    assert problem in capsys.readouterr().err
