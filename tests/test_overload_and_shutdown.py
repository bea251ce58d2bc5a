"""Overload, clients that hang up, an engine that dies, SIGTERM with requests in flight, and a short soak.

What a server must keep true under each: no 5xx but the designed 503s, nothing
left running or holding KV blocks, every stream ends with a last event rather
than a hang or a cut, every trace closed, nothing left behind at exit.
"""

import asyncio
import collections
import concurrent.futures
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest

from tests.patience import patient
from tests.server_checks import group_is_gone, long_context_model, metric, sse_lines, wait_until
from tests.shared_server import ENGINE_FLAGS, model_folder
from tests.tiny_checkpoints import tiny_model_with_tokenizer
from tinyserve.lifecycle import schema
from tinyserve.testing import ServerProcess
from tinyserve.trace_reading.otlp_json import read_spans

pytestmark = pytest.mark.server

MODEL = "tiny"
REPO_ROOT = Path(__file__).resolve().parent.parent
# Requests that must still be running when something happens to the server: thousands of
# tokens, so that no machine is fast enough to finish them first. Anthropic's API has no
# ignore_eos; greedy on this prompt runs 4836 tokens before its end-of-sequence token.
LONG_TOKENS = 6000
LONG_ANTHROPIC_PROMPT = "e"


def is_idle(server) -> bool:
    return not (metric(server.url, "num_requests_running") or metric(server.url, "num_requests_waiting")
                or metric(server.url, "kv_cache_usage_perc"))


def read_stream(url: str, path: str, body: dict, timeout: float = 60) -> tuple[int, list[str]]:
    """POST a streaming request and return its status and every non-empty line."""
    with httpx.stream("POST", f"{url}{path}", json=body, timeout=timeout) as response:
        return response.status_code, [line for line in sse_lines(response) if line]


# ---- overload and disconnects: one server with a 64-block pool and a short waiting queue ----

@pytest.fixture(scope="module")
def busy_server():
    proc = ServerProcess(str(tiny_model_with_tokenizer("llama")), "--served-model-name", MODEL,
                         "--num-kv-blocks", "64", "--max-waiting-requests", "32")
    yield proc
    proc.stop()


def test_a_tight_kv_pool_preempts_and_still_completes_every_request(busy_server):
    # 16 requests of 40 + 200 tokens need 16 × 15 blocks at the end; the pool has 64. Even
    # if they arrive a little apart, far more of them run at once than the pool can hold.
    preemptions_before = metric(busy_server.url, "num_preemptions_total")

    def one(i):
        body = {"model": MODEL, "prompt": [10 + i] * 40, "max_tokens": 200, "ignore_eos": True, "temperature": 0}
        return httpx.post(f"{busy_server.url}/v1/completions", json=body, timeout=120)

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        responses = list(pool.map(one, range(16)))
    assert [r.status_code for r in responses] == [200] * 16
    for response in responses:
        [choice] = response.json()["choices"]
        assert choice["finish_reason"] == "length" and response.json()["usage"]["completion_tokens"] == 200
    assert metric(busy_server.url, "num_preemptions_total") > preemptions_before
    wait_until(lambda: is_idle(busy_server), 10, "the server is idle")


async def _hang_up_at_once(url: str, i: int) -> None:
    """Send a request and close the connection before reading a byte of the answer."""
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps({"model": MODEL, "prompt": f"gone {i}", "max_tokens": 400, "ignore_eos": True,
                       "stream": i % 2 == 0}).encode()
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    await writer.drain()
    await asyncio.sleep(random.Random(i).random() * 0.05)
    writer.close()


async def _storm_and_burst(url: str) -> tuple[list[int], list[tuple[int, str | None, dict]]]:
    """60 streams dropped after 0–4 events, 20 clients that hang up at once, 150 plain requests: all at once."""
    limits = httpx.Limits(max_connections=None)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:
        async def dropped(i: int) -> int:
            body = {"model": MODEL, "messages": [{"role": "user", "content": f"talk {i}"}], "max_tokens": 400,
                    "ignore_eos": True, "stream": True}
            async with client.stream("POST", "/v1/chat/completions", json=body) as response:
                if response.status_code == 200:
                    leave_after, seen = random.Random(i).randint(0, 4), 0
                    async for line in response.aiter_lines():
                        seen += bool(line)
                        if seen > leave_after:
                            break
                return response.status_code

        async def burst(i: int):
            body = {"model": MODEL, "prompt": f"burst {i}", "max_tokens": 16, "ignore_eos": True}
            response = await client.post("/v1/completions", json=body)
            return response.status_code, response.headers.get("retry-after"), response.json()

        async def hang_up(i: int) -> None:
            await _hang_up_at_once(url, i)

        jobs = [(dropped, i) for i in range(60)] + [(burst, i) for i in range(150)] + [(hang_up, i) for i in range(20)]
        random.Random(0).shuffle(jobs)
        results = await asyncio.gather(*[job(i) for job, i in jobs])
    drops = [r for (job, _), r in zip(jobs, results) if job is dropped]
    bursts = [r for (job, _), r in zip(jobs, results) if job is burst]
    return drops, bursts


def test_a_storm_of_dropped_streams_and_a_burst_get_200_or_503_and_leave_nothing_behind(busy_server):
    aborted_before = metric(busy_server.url, "request_success_total")
    rejected_before = metric(busy_server.url, "admission_rejections_total")
    drops, bursts = asyncio.run(_storm_and_burst(busy_server.url))
    assert set(drops) <= {200, 503}
    statuses = collections.Counter(status for status, _, _ in bursts)
    assert set(statuses) == {200, 503}, statuses  # the queue bound was reached, and work still got done
    for status, retry_after, body in bursts:
        if status == 503:
            assert retry_after is not None and int(retry_after) >= 1
            assert body["error"]["type"] == "service_unavailable" and "max_waiting_requests" in body["error"]["message"]
        else:
            assert body["choices"][0]["finish_reason"] == "length"
    wait_until(lambda: is_idle(busy_server), 15, "every request is aborted or finished and every KV block free")
    # Every admitted request was accounted for: finished (burst) or aborted (dropped, hung up).
    accounted = metric(busy_server.url, "request_success_total") - aborted_before
    assert statuses[200] + drops.count(200) <= accounted <= statuses[200] + drops.count(200) + 20
    # vLLM's admission_rejections_total: each 503 of the full queue, under its reason (hang-ups may add theirs)
    rejected = metric(busy_server.url, "admission_rejections_total") - rejected_before
    assert statuses[503] + drops.count(503) <= rejected <= statuses[503] + drops.count(503) + 20
    assert httpx.get(f"{busy_server.url}/health").status_code == 200


# ---- an engine that dies mid-stream ----------------------------------------------------------

def test_engine_death_mid_stream_ends_every_stream_with_an_error_event_and_health_turns_503():
    # Kept alive to look at it afterwards; without the flag it exits (tests/test_engine_death.py).
    proc = ServerProcess(long_context_model(), "--served-model-name", MODEL, "--num-kv-blocks", "2048",
                         "--keep-alive-on-engine-death")
    long = {"max_tokens": LONG_TOKENS, "ignore_eos": True}
    streams = {
        "chat": ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "a"}], **long}),
        "completions": ("/v1/completions", {"model": MODEL, "prompt": ["b", "c"], **long}),
        "messages": ("/v1/messages", {"model": MODEL, "max_tokens": LONG_TOKENS, "temperature": 0,
                                      "messages": [{"role": "user", "content": LONG_ANTHROPIC_PROMPT}]}),
    }
    plain = {"model": MODEL, "messages": [{"role": "user", "content": "e"}], **long}
    try:
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            futures = {name: pool.submit(read_stream, proc.url, path, {**body, "stream": True})
                       for name, (path, body) in streams.items()}
            plain_future = pool.submit(httpx.post, f"{proc.url}/v1/chat/completions", json=plain, timeout=60)
            wait_until(lambda: metric(proc.url, "num_requests_running") == 5 and metric(proc.url, "generation_tokens_total") > 20,
                       30, "all five requests are generating")
            [engine] = [p for p in psutil.Process(proc.process.pid).children() if p.name() == "tinyserve-engine-0"]
            engine.send_signal(signal.SIGKILL)
            results = {name: future.result(timeout=20) for name, future in futures.items()}  # no hang
            plain_response = plain_future.result(timeout=20)
        for name in ("chat", "completions"):
            status, lines = results[name]
            assert status == 200 and lines[-1] == "data: [DONE]"
            error = json.loads(lines[-2].removeprefix("data: "))["error"]
            assert error["code"] == 503 and "engine" in error["message"] and "Traceback" not in error["message"]
        status, lines = results["messages"]
        assert status == 200 and lines[-2] == "event: error"
        assert json.loads(lines[-1].removeprefix("data: "))["error"]["type"] == "overloaded_error"
        assert plain_response.status_code == 503 and "Traceback" not in plain_response.text
        assert httpx.get(f"{proc.url}/health").status_code == 503
        refused = httpx.post(f"{proc.url}/v1/completions", json={"model": MODEL, "prompt": "f"}, timeout=10)
        assert refused.status_code == 503
    finally:
        proc.stop()
    assert proc.group_is_gone()


# ---- SIGTERM with requests in flight --------------------------------------------------------

SHUTDOWN_TIMEOUT = 3.0
SECRET_WORDS = ["zebra-quartz-7", "marmalade-nebula-3", "obsidian-walrus-9"]


@pytest.fixture(scope="module")
def sigterm_run(tmp_path_factory):
    """Six long requests (streamed and not, both APIs) and a short stream in flight, then SIGTERM."""
    trace_dir = tmp_path_factory.mktemp("traces")
    tmpdir = tmp_path_factory.mktemp("server-tmp")
    proc = ServerProcess(long_context_model(), "--served-model-name", MODEL, "--num-kv-blocks", "2048",
                         "--trace", "--trace-dir", str(trace_dir), "--trace-redact-inputs",
                         "--shutdown-timeout", str(SHUTDOWN_TIMEOUT), env={"TMPDIR": str(tmpdir)})
    long = {"max_tokens": LONG_TOKENS, "ignore_eos": True}
    chat = {"model": MODEL, "messages": [{"role": "system", "content": SECRET_WORDS[2]},
                                         {"role": "user", "content": f"say {SECRET_WORDS[0]}"}], **long}
    message = {"model": MODEL, "max_tokens": LONG_TOKENS, "temperature": 0,
               "messages": [{"role": "user", "content": LONG_ANTHROPIC_PROMPT}]}
    streams = {
        "chat_stream": ("/v1/chat/completions", {**chat, "stream": True}),
        "completions_stream": ("/v1/completions", {"model": MODEL, "prompt": [f"{SECRET_WORDS[1]} a", "b"],
                                                   "stream": True, **long}),
        "messages_stream": ("/v1/messages", {**message, "stream": True}),
    }
    plain = {"chat": ("/v1/chat/completions", chat), "messages": ("/v1/messages", message)}
    # Its stop string is user text as well: the redacted trace must not keep it either.
    short = {"model": MODEL, "messages": [{"role": "user", "content": f"short {SECRET_WORDS[1]}"}], "max_tokens": 8,
             "ignore_eos": True, "stream": True, "stop": [SECRET_WORDS[2]]}
    try:
        with concurrent.futures.ThreadPoolExecutor(5) as pool:
            futures = {name: pool.submit(read_stream, proc.url, path, body) for name, (path, body) in streams.items()}
            futures.update({name: pool.submit(httpx.post, proc.url + path, json=body, timeout=60)
                            for name, (path, body) in plain.items()})
            wait_until(lambda: metric(proc.url, "num_requests_running") == 6, 30, "the six long requests are running")
            with httpx.stream("POST", f"{proc.url}/v1/chat/completions", json=short, timeout=60) as response:
                lines = sse_lines(response)
                short_lines = [next(lines)]  # the first event: the request is in the engine
                signalled = time.monotonic()
                proc.process.send_signal(signal.SIGTERM)
                short_lines += [line for line in lines if line]
            # uvicorn notices the signal on its next tick; the late request must come after that.
            wait_until(lambda: "draining" in proc.output(), 10, "the server starts draining")
            try:
                late = httpx.post(f"{proc.url}/v1/completions", json={"model": MODEL, "prompt": "late"}, timeout=10)
                late_outcome = late.status_code
            except httpx.ConnectError:
                late_outcome = "refused"
            proc.process.wait(60)
            exited_after = time.monotonic() - signalled
            group_gone = proc.group_is_gone()
            results = {name: future.result(timeout=10) for name, future in futures.items()}
            results["short"] = (response.status_code, short_lines)
    finally:
        output = proc.stop()
    [run] = list(trace_dir.iterdir())
    return {"results": results, "late": late_outcome, "exited_after": exited_after, "group_gone": group_gone,
            "run": run, "tmpdir": tmpdir, "output": output}


def test_sigterm_exits_soon_after_the_timeout_leaving_no_process_socket_or_temp_file(sigterm_run):
    from tinyserve.entrypoints.api.guards.shutdown import ABORT_GRACE_S

    assert sigterm_run["exited_after"] < SHUTDOWN_TIMEOUT + ABORT_GRACE_S, sigterm_run["output"][-3000:]
    assert sigterm_run["group_gone"], "a process of the server's group outlived it"
    assert not [p for p in sigterm_run["tmpdir"].iterdir() if p.name.startswith("tinyserve-")]
    assert "Traceback" not in sigterm_run["output"]


def test_new_requests_after_sigterm_are_refused(sigterm_run):
    assert sigterm_run["late"] in ("refused", 503)


def test_a_request_that_fits_in_the_drain_finishes_normally(sigterm_run):
    status, lines = sigterm_run["results"]["short"]
    assert status == 200 and lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2].removeprefix("data: "))["choices"][0]["finish_reason"] == "length"


def test_streams_still_running_at_the_timeout_end_with_abort_and_their_last_event(sigterm_run):
    results = sigterm_run["results"]
    status, lines = results["chat_stream"]
    assert status == 200 and lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2].removeprefix("data: "))["choices"][0]["finish_reason"] == "abort"
    status, lines = results["completions_stream"]
    assert status == 200 and lines[-1] == "data: [DONE]"
    choices = [json.loads(line.removeprefix("data: "))["choices"][0] for line in lines[:-1]]
    assert sorted(c["index"] for c in choices if c["finish_reason"] == "abort") == [0, 1]
    status, lines = results["messages_stream"]
    assert status == 200 and lines[-2] == "event: error" and "shutting down" in lines[-1]


def test_plain_requests_still_running_at_the_timeout_are_answered_as_aborted(sigterm_run):
    chat = sigterm_run["results"]["chat"]
    assert chat.status_code == 200 and chat.json()["choices"][0]["finish_reason"] == "abort"
    messages = sigterm_run["results"]["messages"]
    assert messages.status_code == 503 and messages.json()["error"]["type"] == "overloaded_error"
    assert "shutting down" in messages.json()["error"]["message"]


def test_every_trace_line_parses_and_every_request_trace_is_closed(sigterm_run):
    run = sigterm_run["run"]
    assert sorted(p.name for p in run.glob("*.jsonl")) == [schema.API_TRACE_FILE, schema.engine_trace_file(0)]
    for path in run.glob("*.jsonl"):
        for line in path.read_text().splitlines():
            json.loads(line)
    spans = [span for path in sorted(run.glob("*.jsonl")) for span in read_spans(path)]
    traces = collections.defaultdict(list)
    for span in spans:
        traces[span.trace_id].append(span)
    request_traces = [ss for ss in traces.values() if not any(s.name == schema.STEP for s in ss)]
    assert len(request_traces) == 6  # the late request never reached the app
    reasons = []
    for trace_spans in request_traces:
        ids = {s.span_id for s in trace_spans}
        [root] = [s for s in trace_spans if s.parent_span_id not in ids]
        assert root.name.startswith("POST /v1/")
        request_spans = [s for s in trace_spans if s.name.startswith(("chat ", "text_completion "))]
        assert request_spans, root.name
        for request_span in request_spans:
            reasons += request_span.attributes[schema.GEN_AI_RESPONSE_FINISH_REASONS]
        assert any(s.name == schema.QUEUE for s in trace_spans), "the engine did not flush its spans"
    assert sorted(reasons) == ["abort"] * 6 + ["length"]


def test_redacted_trace_holds_no_prompt_output_text_or_token_ids(sigterm_run):
    run = sigterm_run["run"]
    raw = "".join(path.read_text() for path in run.glob("*.jsonl"))
    for word in SECRET_WORDS:
        assert word not in raw
    _, lines = sigterm_run["results"]["short"]
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    short_text = "".join(chunk["choices"][0]["delta"].get("content", "") for chunk in chunks)
    if len(short_text) >= 8:
        assert json.dumps(short_text)[1:-1] not in raw
    spans = [span for path in run.glob("*.jsonl") for span in read_spans(path)]
    forbidden = {schema.PROMPT, schema.PROMPT_TOKEN_IDS, schema.MESSAGES, schema.OUTPUT_TEXT, schema.OUTPUT_TOKEN_IDS,
                 schema.COMPLETIONS, schema.STOP_STRING}
    assert not any(forbidden & set(span.attributes) for span in spans)
    renders = [span for span in spans if span.name == schema.RENDER]
    assert len(renders) == 7 and all(span.attributes[schema.INPUTS_REDACTED] for span in renders)
    assert all(span.attributes[schema.NUM_PROMPT_TOKENS] > 0 for span in renders)


# ---- a short soak -------------------------------------------------------------------------------

def test_short_soak_has_no_5xx_a_complete_trace_and_an_idle_server_at_the_end(tmp_path):
    report_path = tmp_path / "soak.json"
    command = [sys.executable, str(REPO_ROOT / "benchmarks" / "soak.py"), str(tiny_model_with_tokenizer("llama")),
               "--duration", "10", "--rate", "4", "--max-tokens", "8", "--serve-arg=--num-kv-blocks=128",
               "--json", str(report_path)]
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    finished = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert finished.returncode == 0, finished.stdout[-3000:] + finished.stderr[-3000:]
    report = json.loads(report_path.read_text())
    assert report["ok"] and report["http_5xx"] == 0 and not report["failures"]
    assert report["requests_sent"] == 40 and report["outcomes"]["completed"] > 20
    assert report["trace"]["request_traces"] == 40
    assert any(name.startswith("api ") for name in report["rss_start"])
    assert any(name.startswith("tinyserve-engine-0 ") for name in report["rss_end"])


# ---- SIGTERM at each stage of start-up ---------------------------------------------------------

def _descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _sigterm_caught(process, log) -> bool:
    """The API process catches SIGTERM (its handler is in, the kernel's SigCgt mask says so): no default death."""
    try:
        with open(f"/proc/{process.pid}/status") as status:
            caught = int(next(line for line in status if line.startswith("SigCgt:")).split()[1], 16)
    except (FileNotFoundError, StopIteration):
        return False
    return bool(caught & (1 << (signal.SIGTERM - 1)))


def _engine_spawned(process, log) -> bool:
    """An engine interpreter exists (it may still be importing torch): the API process imports the rest of itself."""
    return any("tinyserve.engine.child_process" in " ".join(_cmdline(p)) or _is_engine(p)
               for p in _descendants(process.pid))


def _engine_loading_and_uvicorn_waiting(process, log) -> bool:
    """The engine has its title (it builds the model, profiles and warms up); uvicorn waits for it."""
    return "Started server process" in log() and any(_is_engine(p) for p in _descendants(process.pid))


def _engines_ready(process, log) -> bool:
    """Every engine said READY: uvicorn runs the app's start-up and binds."""
    return "engine(s) ready" in log()


def _cmdline(process: psutil.Process) -> list[str]:
    try:
        return process.cmdline()
    except psutil.Error:
        return []


def _is_engine(process: psutil.Process) -> bool:
    return any(arg.startswith("tinyserve-engine") for arg in _cmdline(process)[:1])


@pytest.mark.parametrize("stage", [None, _sigterm_caught, _engine_spawned, _engine_loading_and_uvicorn_waiting,
                                   _engines_ready],
                         ids=["at-spawn", "handler-in", "engine-spawned", "engine-loading", "engines-ready"])
def test_sigterm_at_any_stage_of_start_up_exits_promptly_leaving_no_process_or_socket_directory(stage, tmp_path):
    """Whenever SIGTERM comes, the server is gone soon after, with status 0 and nothing left of it.

    The stage is observed, not guessed from a delay: the kernel's mask of caught signals, the
    engine's process, its title, the log. At spawn the interpreter may not have reached our handler
    yet (serve.py's run() installs it first): the default action then ends it (status -SIGTERM)
    before it could start anything. Each case takes 1-30 s, the last a whole start of the tiny model.
    """
    command = [sys.executable, "-m", "tinyserve.cli.main", "serve", model_folder(), "--port", "0", *ENGINE_FLAGS]
    with open(tmp_path / "log", "w+b") as log_file:
        def log() -> str:
            return os.pread(log_file.fileno(), 1 << 22, 0).decode(errors="replace")

        process = subprocess.Popen(command, env=dict(os.environ, PYTHONUNBUFFERED="1", TMPDIR=str(tmp_path)),
                                   stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True)
        seen: set[psutil.Process] = set()
        try:
            if stage is not None:
                deadline = time.monotonic() + patient(60)
                while not stage(process, log):
                    seen.update(_descendants(process.pid))
                    assert process.poll() is None, log()[-3000:]
                    assert time.monotonic() < deadline, f"timed out waiting for {stage.__doc__}"
                    time.sleep(0.02)
            seen.update(_descendants(process.pid))
            process.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            status = process.wait(patient(10))
            exited_after = time.monotonic() - signalled
            wait_until(lambda: not any(_alive(p) for p in seen), 5,
                       "every process the server started is gone")
            wait_until(lambda: group_is_gone(process.pid), 5, "no process of the server's group is left")
        finally:
            if process.poll() is None or not group_is_gone(process.pid):
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        output = log()
    assert status == 0 or (stage is None and status == -signal.SIGTERM), (status, output[-3000:])
    # An engine that ignored SIGTERM would be SIGKILLed after 5 s; an idle machine takes 1-2 s in all.
    assert exited_after < patient(5), (exited_after, output[-3000:])
    assert "Traceback" not in output, output[-3000:]
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith("tinyserve-")]


def _alive(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
