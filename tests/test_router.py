"""`tinyserve router` in front of two real `tinyserve serve` backends, on loopback.

Two --data-parallel-rank servers (ranks 0 and 1 of 2), traced, with vLLM's metric names,
shared by every test here; each test starts the router it needs (a process of a second
or two). The clients are the official openai one and httpx.
"""

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from tests import shared_server
from tests.server_checks import wait_until
from tinyserve.lifecycle import schema
from tinyserve.lifecycle.otlp_json import read_spans
from tinyserve.testing import RouterProcess, ServerProcess, free_port

pytestmark = pytest.mark.server

MODEL = shared_server.MODEL


@pytest.fixture(scope="module")
def backends(tmp_path_factory):
    """The two backend servers, started together, each tracing into a folder of its own."""
    model = shared_server.model_folder()
    flags = [(*shared_server.ENGINE_FLAGS, "--data-parallel-size", "2", "--data-parallel-rank", str(rank),
              "--metrics-prefix", "vllm", "--trace", "--trace-dir", str(tmp_path_factory.mktemp(f"backend{rank}")))
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
def traced_router(backends, tmp_path_factory):
    """round_robin over both backends, tracing into a folder of its own."""
    folder = tmp_path_factory.mktemp("router")
    router = RouterProcess([server.url for server in backends], "--trace", "--trace-dir", str(folder))
    yield router
    router.stop()


def run_folder(process) -> Path:
    [line] = [line for line in process.output().splitlines() if "tinyserve: tracing to " in line]
    return Path(line.split("tinyserve: tracing to ")[1].strip())


def spans_in(folder: Path) -> list:
    return [span for file in sorted(folder.glob("*.jsonl")) for span in read_spans(file)]


def test_chat_and_completions_pass_through_streamed_and_whole_as_the_backend_answers(backends, traced_router):
    via_router = openai.OpenAI(base_url=f"{traced_router.url}/v1", api_key="unused", max_retries=0)
    direct = openai.OpenAI(base_url=f"{backends[0].url}/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "Tell me about the router."}]
    chat = dict(model=MODEL, messages=messages, max_tokens=12, temperature=0)
    expected_chat = direct.chat.completions.create(**chat).choices[0].message.content
    assert via_router.chat.completions.create(**chat).choices[0].message.content == expected_chat
    streamed = via_router.chat.completions.create(**chat, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == expected_chat
    completion = dict(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=0)
    expected_text = direct.completions.create(**completion).choices[0].text
    assert via_router.completions.create(**completion).choices[0].text == expected_text
    chunks = list(via_router.completions.create(**completion, stream=True))
    assert len(chunks) > 2  # passed through chunk by chunk, not gathered into one
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected_text
    assert [m.id for m in via_router.models.list().data] == [MODEL]
    assert httpx.get(f"{traced_router.url}/health", timeout=10).json()["status"] == "ok"


def test_the_backends_request_spans_carry_the_routers_trace_and_merge_into_one_run(backends, traced_router,
                                                                                   tmp_path):
    from tinyserve.lifecycle.merge import merge_runs
    from tinyserve.lifecycle.run import load_run

    via_router = openai.OpenAI(base_url=f"{traced_router.url}/v1", api_key="unused", max_retries=0)
    for i in range(2):  # round robin: one to each backend
        via_router.completions.create(model=MODEL, prompt=f"Trace me {i}", max_tokens=4, temperature=0)
    router_folder = run_folder(traced_router)

    def routes() -> list:
        return [s for s in spans_in(router_folder) if s.name == schema.ROUTE]

    wait_until(lambda: len(routes()) >= 2, 30, "the router wrote its route spans")
    backend_folders = [run_folder(server) for server in backends]
    for route in routes()[-2:]:
        index = route.attributes[schema.ROUTER_BACKEND_INDEX]
        assert route.attributes[schema.ROUTER_POLICY] == "round_robin"
        assert route.attributes[schema.ROUTER_BACKEND] == backends[index].url

        def backend_http_span():
            return [s for s in spans_in(backend_folders[index])
                    if s.trace_id == route.trace_id and s.parent_span_id == route.span_id]

        wait_until(backend_http_span, 30, "the backend wrote the request's HTTP span under the router's")
    merged = merge_runs([router_folder, *backend_folders], tmp_path / "merged")
    assert sorted(p.name for p in merged.glob("*.jsonl")) == ["api-0.jsonl", "api-1.jsonl", "engine-0.jsonl",
                                                             "engine-1.jsonl", "router.jsonl"]
    run = load_run(merged)
    traced = {span.trace_id for span in routes()}
    assert {r.trace_id for r in run.requests} & traced


def test_a_backend_that_is_down_is_passed_over_and_none_left_is_a_503_naming_it(backends):
    dead = f"http://127.0.0.1:{free_port()}"
    router = RouterProcess([dead, backends[0].url])
    try:
        client = openai.OpenAI(base_url=f"{router.url}/v1", api_key="unused", max_retries=0)
        for _ in range(3):
            assert client.completions.create(model=MODEL, prompt="Hi", max_tokens=2).choices[0].text is not None
    finally:
        router.stop()
    nothing = subprocess.Popen([sys.executable, "-m", "tinyserve.cli.main", "router", "--backend", dead, "--port",
                                str(port := free_port())], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        def answer():
            try:
                return httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"model": MODEL, "prompt": "Hi"},
                                  timeout=10)
            except httpx.HTTPError:
                return None

        wait_until(answer, 30, "the router listens")
        refused = answer()
        assert refused.status_code == 503
        assert dead in refused.json()["error"]["message"]
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).status_code == 503
    finally:
        nothing.terminate()
        nothing.wait(30)


@pytest.mark.parametrize(("flags", "message"), [
    ([], "--backend needs at least one URL"),
    (["--backend", "127.0.0.1:8001"], "is not an http(s) URL"),
])
def test_bad_flags_are_refused_naming_them(flags, message, capsys):
    from tinyserve.cli.main import main

    assert main(["router", *flags]) == 2
    assert message in capsys.readouterr().err
