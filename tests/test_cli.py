"""`tinyserve chat`, `complete` and `run-batch`, run as the user runs them: subprocesses.

The reference for every answer is the server itself, asked through the official
openai client (or plain HTTP) at temperature 0: the commands must print, or write,
exactly what the server answers.
"""

import json
import signal
import socket
import subprocess
import sys

import httpx
import openai
import pytest

from tests.patience import patient
from tests.shared_server import ENGINE_FLAGS, MODEL, model_folder
from tinyserve.cli.main import main
from tinyserve.testing import free_port


def tinyserve(*args: str, stdin: str = "") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tinyserve.cli.main", *args], input=stdin,
                          capture_output=True, text=True, timeout=patient(60))  # run-batch builds an engine


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def greedy_chat(client, messages: list[dict]) -> str:
    response = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
    return response.choices[0].message.content


# ---- chat and complete -------------------------------------------------------------


@pytest.mark.server
def test_chat_quick_prints_the_servers_reply_and_exits_0(server, client):
    expected = greedy_chat(client, [{"role": "user", "content": "hi"}])
    result = tinyserve("chat", "--url", f"{server.url}/v1", "--quick", "hi", "--max-tokens", "8", "--temperature", "0")
    assert result.returncode == 0, result.stderr
    assert expected.strip()
    assert result.stdout == expected + "\n"


@pytest.mark.server
def test_complete_quick_prints_the_servers_completion_and_exits_0(server, client):
    prompt = "Flat is better than"
    expected = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0).choices[0].text
    result = tinyserve("complete", "--url", f"{server.url}/v1", "--model", MODEL, "--quick", prompt,
                       "--max-tokens", "8", "--temperature", "0")
    assert result.returncode == 0, result.stderr
    assert expected.strip()
    assert result.stdout == expected + "\n"


@pytest.mark.server
def test_interactive_chat_keeps_the_history_and_ends_on_eof(server, client):
    system = {"role": "system", "content": "Answer briefly."}
    first = greedy_chat(client, [system, {"role": "user", "content": "hi"}])
    second = greedy_chat(client, [system, {"role": "user", "content": "hi"}, {"role": "assistant", "content": first},
                                  {"role": "user", "content": "and then?"}])
    result = tinyserve("chat", "--url", f"{server.url}/v1", "--system", system["content"], "--max-tokens", "8",
                       "--temperature", "0", stdin="hi\nand then?\n")
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"> {first}\n> {second}\n> \n"


def test_unreachable_server_is_one_clear_line_and_exit_1():
    url = f"http://127.0.0.1:{free_port()}/v1"
    result = tinyserve("chat", "--url", url, "--quick", "hi")
    assert result.returncode == 1
    assert result.stdout == ""
    assert "Traceback" not in result.stderr
    [line] = result.stderr.splitlines()
    assert line.startswith("error: cannot reach the server at") and url in line
    assert "--url" in line and "TINYSERVE_URL" in line  # how to point it at `make serve PORT=...`


@pytest.mark.parametrize("command", ["chat", "complete"])
def test_the_clients_find_the_server_at_tinyserve_url(command, monkeypatch):
    from tinyserve.cli.main import build_parser

    monkeypatch.delenv("TINYSERVE_URL", raising=False)
    assert build_parser().parse_args([command]).url == "http://localhost:8000/v1"
    monkeypatch.setenv("TINYSERVE_URL", "http://127.0.0.1:8080/v1")  # as `make chat PORT=8080` sets it
    assert build_parser().parse_args([command]).url == "http://127.0.0.1:8080/v1"
    assert build_parser().parse_args([command, "--url", "http://h:1/v1"]).url == "http://h:1/v1"


@pytest.mark.server
def test_an_error_answer_is_one_line_with_the_servers_message_and_exit_1(server, capsys):
    # In this process (main() is what the `tinyserve` script calls): no second interpreter to start.
    body = {"model": "nope", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    reference = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
    url = f"{server.url}/v1"
    assert main(["chat", "--url", url, "--model", "nope", "--quick", "hi", "--max-tokens", "8"]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == f"error: the server at {url} answered {reference.status_code}: {reference.json()['error']['message']}\n"


# ---- run-batch -----------------------------------------------------------------------


def batch_line(custom_id: str, url: str, body: dict) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


CHAT_BODY = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "temperature": 0}
COMPLETION_BODY = {"model": MODEL, "prompt": "Flat is better than", "max_tokens": 8, "temperature": 0}
BAD_BODY = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "temperature": -1}


@pytest.mark.server
def test_run_batch_answers_every_line_in_order_as_the_server_would(server, tmp_path):
    lines = [
        batch_line("chat", "/v1/chat/completions", CHAT_BODY),
        batch_line("completion", "/v1/completions", COMPLETION_BODY),
        '{"custom_id": "broken", "method": "POST", ',
        batch_line("bad-temperature", "/v1/chat/completions", BAD_BODY),
        batch_line("embeddings", "/v1/embeddings", {"model": MODEL, "input": "hi"}),
        batch_line("files", "/v1/files", {"model": MODEL}),
    ]
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    result = tinyserve("run-batch", "-i", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl"),
                       model_folder(), *ENGINE_FLAGS)
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]

    assert [r["custom_id"] for r in records] == ["chat", "completion", None, "bad-temperature", "embeddings",
                                                 "files"]
    assert all(r["id"].startswith("batch_req_") for r in records)
    assert len({r["id"] for r in records}) == len(records)
    chat, completion, broken, bad, embeddings, files = records

    # Answered lines: the endpoint's status and body, exactly as the running server answers them.
    reference_chat = httpx.post(f"{server.url}/v1/chat/completions", json=CHAT_BODY, timeout=60).json()
    assert chat["error"] is None and chat["response"]["status_code"] == 200
    assert chat["response"]["request_id"] == chat["response"]["body"]["id"]
    assert chat["response"]["body"]["object"] == "chat.completion"
    assert chat["response"]["body"]["choices"][0]["message"] == reference_chat["choices"][0]["message"]
    assert chat["response"]["body"]["usage"] == reference_chat["usage"]

    reference_completion = httpx.post(f"{server.url}/v1/completions", json=COMPLETION_BODY, timeout=60).json()
    assert completion["error"] is None and completion["response"]["status_code"] == 200
    assert completion["response"]["body"]["choices"][0]["text"] == reference_completion["choices"][0]["text"]

    reference_bad = httpx.post(f"{server.url}/v1/chat/completions", json=BAD_BODY, timeout=60)
    assert reference_bad.status_code == 400
    assert bad["error"] is None
    assert bad["response"]["status_code"] == 400
    assert bad["response"]["body"] == reference_bad.json()
    assert bad["response"]["request_id"].startswith("req_")

    # Lines that could not be sent: no response, an error code and message instead.
    assert broken["response"] is None and broken["error"]["code"] == "invalid_json_line"
    assert broken["error"]["message"].startswith("line 3: ")
    assert files["response"] is None and files["error"]["code"] == "invalid_url"
    assert "/v1/files" in files["error"]["message"]
    # An embeddings line goes to its endpoint: this engine generates, so the endpoint's 400 says so.
    assert embeddings["error"] is None and embeddings["response"]["status_code"] == 400
    assert "does not support Embeddings API" in embeddings["response"]["body"]["error"]["message"]


# The two failures below stop before any engine work, so they too run in this process.


def test_run_batch_without_a_readable_input_file_exits_1(tmp_path, capsys):
    missing = tmp_path / "missing.jsonl"
    assert main(["run-batch", "-i", str(missing), "-o", str(tmp_path / "out.jsonl")]) == 1
    assert capsys.readouterr().err.startswith(f"error: cannot read the input file {missing}")


def test_run_batch_with_a_model_that_cannot_load_exits_1_and_keeps_the_old_output(tmp_path, capsys):
    (tmp_path / "in.jsonl").write_text(batch_line("chat", "/v1/chat/completions", CHAT_BODY) + "\n")
    (tmp_path / "out.jsonl").write_text("records of an earlier run\n")
    argv = ["run-batch", "-i", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl"), str(tmp_path / "no-such-model")]
    assert main(argv) == 1
    assert capsys.readouterr().err.startswith("error: cannot load the model")
    assert (tmp_path / "out.jsonl").read_text() == "records of an earlier run\n"
    # vLLM's spelling, --model, names the model too.
    assert main(argv[:-1] + ["--model", str(tmp_path / "no-such-model")]) == 1
    assert capsys.readouterr().err.startswith("error: cannot load the model")


def test_run_batch_into_a_directory_exits_1_before_loading_anything(tmp_path, capsys):
    (tmp_path / "in.jsonl").write_text(batch_line("chat", "/v1/chat/completions", CHAT_BODY) + "\n")
    assert main(["run-batch", "-i", str(tmp_path / "in.jsonl"), "-o", str(tmp_path)]) == 1
    assert capsys.readouterr().err == f"error: cannot write the output file {tmp_path}: it is a directory\n"


def test_a_model_folder_read_as_a_served_model_name_or_two_models_are_exit_2(tmp_path, capsys):
    folder = tmp_path / "model"
    folder.mkdir()
    common = ["run-batch", "-i", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl")]
    assert main([*common, "--served-model-name", "tiny", str(folder)]) == 2
    assert "was read as a --served-model-name; put the model before the flags" in capsys.readouterr().err
    assert main([*common, str(folder), "--model", str(tmp_path / "other")]) == 2
    assert "two models given" in capsys.readouterr().err


def test_a_model_with_a_broken_config_names_the_file(tmp_path, capsys):
    (tmp_path / "in.jsonl").write_text(batch_line("chat", "/v1/chat/completions", CHAT_BODY) + "\n")
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{model_type: llama")
    assert main(["run-batch", "-i", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl"), str(folder)]) == 1
    assert f"{folder / 'config.json'} is not valid JSON" in capsys.readouterr().err


def test_serve_listens_with_nagles_algorithm_off_on_every_connection():
    # A response's body follows its headers in a second write; with Nagle's algorithm on it
    # waits for the client's delayed ACK of the headers (40 ms on Linux): every response late.
    # The listener is served the way uvicorn serves it: loop.create_server(sock=...).
    import asyncio

    from tinyserve.cli.listener import bind_listener

    async def accepted_socket_nodelay() -> int:
        loop = asyncio.get_running_loop()
        accepted = loop.create_future()

        class Probe(asyncio.Protocol):
            def connection_made(self, transport):
                sock = transport.get_extra_info("socket")
                accepted.set_result(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))

        listener = bind_listener("127.0.0.1", 0)
        server = await loop.create_server(Probe, sock=listener)
        _, writer = await asyncio.open_connection(*listener.getsockname())
        try:
            return await asyncio.wait_for(accepted, 10)
        finally:
            writer.close()
            server.close()

    assert asyncio.run(accepted_socket_nodelay()) == 1


def test_serve_on_a_taken_port_or_a_bad_one_exits_2_before_loading_the_model(tmp_path, capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        # The model does not exist either: the port is checked first, so that is what is reported.
        assert main(["serve", str(tmp_path / "no-such-model"), "--port", str(port)]) == 2
    assert capsys.readouterr().err.startswith(f"error: cannot listen on 127.0.0.1:{port}: ")
    assert main(["serve", str(tmp_path / "no-such-model"), "--port", "70000"]) == 2
    assert capsys.readouterr().err == "error: --port must be in [0, 65535], got 70000\n"


@pytest.mark.parametrize("flags, message", [
    (["--headless", "--data-parallel-size", "2"],
     "--headless needs --data-parallel-start-rank (the first rank this node serves)"),
    (["--headless", "--data-parallel-size", "4", "--data-parallel-size-local", "2", "--data-parallel-start-rank", "3"],
     "--data-parallel-start-rank 3 with --data-parallel-size-local 2 must fit in ranks [1, 4) (rank 0 is the "
     "head's); got ranks 3-4"),
    (["--data-parallel-size", "2", "--data-parallel-size-local", "3"],
     "--data-parallel-size-local must be in [1, --data-parallel-size=2], got 3"),
    (["--data-parallel-size", "2", "--data-parallel-start-rank", "1"],
     "--data-parallel-start-rank 1 is for --headless nodes; the head always starts at rank 0"),
    (["--data-parallel-size", "2", "--data-parallel-rank", "1", "--data-parallel-size-local", "2"],
     "--data-parallel-rank runs one engine: --data-parallel-size-local must be 1 or unset, got 2"),
    (["--headless", "--data-parallel-size", "2", "--data-parallel-size-local", "1", "--data-parallel-start-rank", "1",
      "--data-parallel-rank", "1"],
     "--data-parallel-rank is for a server of its own; a --headless node takes --data-parallel-start-rank"),
])
def test_data_parallel_flags_that_cannot_fit_exit_2_naming_them(tmp_path, capsys, flags, message):
    assert main(["serve", str(tmp_path / "no-such-model"), *flags]) == 2
    assert capsys.readouterr().err == f"error: {message}\n"


def test_serve_refuses_a_data_parallel_rank_outside_its_group_before_loading_the_model(tmp_path, capsys):
    model = str(tmp_path / "no-such-model")
    # As vLLM: a rank names one engine of several; with one engine there is nothing to name.
    assert main(["serve", model, "--data-parallel-rank", "0"]) == 2
    assert capsys.readouterr().err == (
        "error: --data-parallel-rank needs --data-parallel-size of at least 2 (it names one engine of several, "
        "for a load balancer in front), got --data-parallel-size 1\n")
    for rank in ("2", "-1"):
        assert main(["serve", model, "--data-parallel-size", "2", "--data-parallel-rank", rank]) == 2
        assert capsys.readouterr().err == (
            f"error: --data-parallel-rank must be in [0, 2) for --data-parallel-size 2, got {rank}\n")


def test_serve_help_describes_the_external_load_balancing_flags(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--help"])
    assert exit_.value.code == 0
    help_text = " ".join(capsys.readouterr().out.split())
    assert "external load balancing:" in help_text
    assert "--data-parallel-rank R serve data-parallel rank R of --data-parallel-size alone" in help_text
    assert "--enable-server-load-tracking count the generation requests in flight, for GET /load" in help_text


def test_run_batch_reads_a_line_holding_unicode_line_breaks_as_one_line(tmp_path):
    from tinyserve.cli.run_batch import _read_lines

    body = {**COMPLETION_BODY, "prompt": "a\x85b\u2028c"}
    lines = [batch_line("one", "/v1/completions", body), batch_line("two", "/v1/completions", COMPLETION_BODY)]
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join(json.dumps(json.loads(line), ensure_ascii=False) for line in lines) + "\n",
                    encoding="utf-8")
    assert "\x85" in path.read_text(encoding="utf-8")  # raw, as a JSON writer may leave it
    read = _read_lines(str(path))
    assert [number for number, _ in read] == [1, 2]
    assert json.loads(read[0][1])["body"]["prompt"] == "a\x85b\u2028c"


def test_a_sigterm_swallowed_during_start_up_still_stops_the_server_before_it_serves():
    from tinyserve.cli import start_up_sigterm

    try:
        try:
            start_up_sigterm.exit_on_sigterm(signal.SIGTERM, None)  # as if it came during an import with a bare `except:`
        except BaseException:  # noqa: BLE001 - what such a library does
            pass
        with pytest.raises(SystemExit) as exited:
            start_up_sigterm.exit_if_sigterm_received()
        assert exited.value.code == 0
    finally:
        start_up_sigterm.received.clear()
    start_up_sigterm.exit_if_sigterm_received()  # without a SIGTERM it returns
