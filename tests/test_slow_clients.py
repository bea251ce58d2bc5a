"""A slow client cannot hold a connection for ever: its headers and its body each have a deadline.

Raw sockets send a request a byte at a time, or nothing at all; the server
answers 408 and closes the connection once the deadline (1 s here) passes,
while the client is still sending. Responses are not bound by the deadlines: a
stream that lasts longer than them runs to its end.
"""

import json
import socket
import time

import httpx
import pytest

from tests.server_checks import sse_lines
from tests.tiny_checkpoints import tiny_model_with_tokenizer
from tinyserve.testing import ServerProcess

pytestmark = pytest.mark.server  # a real `tinyserve serve` on loopback

MODEL = "tiny"
TIMEOUT_S = 1.0
GIVE_UP_S = 10.0  # without deadlines the server would wait for ever; this long is proof enough


@pytest.fixture(scope="module")
def server():
    proc = ServerProcess(str(tiny_model_with_tokenizer("llama", max_position_embeddings=4096)),
                         "--served-model-name", MODEL, "--num-kv-blocks", "512",
                         "--http-header-timeout", str(TIMEOUT_S), "--http-body-timeout", str(TIMEOUT_S),
                         "--timeout-keep-alive", str(TIMEOUT_S))
    yield proc
    proc.stop()


def connect(server) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), timeout=GIVE_UP_S)


def trickle(sock: socket.socket, data: bytes, every: float = 0.2) -> tuple[bytes, float]:
    """Send `data` a byte at a time until the server closes the connection; what it answered, and when."""
    began, answer = time.monotonic(), b""
    sock.settimeout(every)
    for byte in data:
        try:
            sock.sendall(bytes([byte]))
            chunk = sock.recv(65536)
        except socket.timeout:
            continue
        except (BrokenPipeError, ConnectionResetError):
            break
        if not chunk:
            break
        answer += chunk
    else:
        pytest.fail("the client sent its whole request: the server never closed the connection")
    return answer, time.monotonic() - began


def status_and_error(answer: bytes) -> tuple[int, dict]:
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)["error"]


def test_headers_sent_a_byte_at_a_time_are_cut_off_with_408(server):
    headers = b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n" + b"x" * 200
    with connect(server) as sock:
        answer, took = trickle(sock, headers)
    assert TIMEOUT_S <= took < TIMEOUT_S + 5
    status, error = status_and_error(answer)
    assert status == 408 and "--http-header-timeout" in error["message"]


def test_a_connection_that_sends_nothing_is_closed_without_an_answer(server):
    began = time.monotonic()
    with connect(server) as sock:
        assert sock.recv(65536) == b""  # closed by the server, not by a timeout here
    assert TIMEOUT_S <= time.monotonic() - began < TIMEOUT_S + 5


def test_a_body_sent_a_byte_at_a_time_is_cut_off_with_408_in_the_endpoint_format(server):
    body = json.dumps({"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "x" * 200}]})
    head = (f"POST /v1/messages HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\n\r\n").encode()
    with connect(server) as sock:
        sock.sendall(head)  # the headers in time; the body trickles
        answer, took = trickle(sock, body.encode())
    assert TIMEOUT_S <= took < TIMEOUT_S + 5
    status, error = status_and_error(answer)
    assert status == 408 and "--http-body-timeout" in error["message"]
    assert error["type"] == "invalid_request_error"  # Anthropic's error body on /v1/messages
    assert json.loads(answer.partition(b"\r\n\r\n")[2])["type"] == "error"


def read_response(sock) -> bytes:
    """One whole HTTP response (headers, then Content-Length bytes of body), however it is split into packets."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    headers = dict(line.lower().split(b": ", 1) for line in head.split(b"\r\n")[1:])
    length = int(headers[b"content-length"])
    while len(body) < length:
        body += sock.recv(65536)
    return data


def test_an_idle_keep_alive_connection_is_closed_without_an_answer(server):
    with connect(server) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n")
        assert read_response(sock).startswith(b"HTTP/1.1 200")
        began = time.monotonic()
        assert sock.recv(65536) == b""  # no answer a next request could take for its own
    assert time.monotonic() - began < TIMEOUT_S + 5


def test_the_next_request_on_a_kept_alive_connection_has_its_deadline_too(server):
    with connect(server) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n")
        assert read_response(sock).startswith(b"HTTP/1.1 200")
        answer, took = trickle(sock, b"GET /health HTTP/1.1\r\nhost: 127.0.0.1\r\n" + b"x" * 100)
    assert TIMEOUT_S <= took < TIMEOUT_S + 5
    assert status_and_error(answer)[0] == 408


def test_a_stream_longer_than_the_deadlines_runs_to_its_end(server):
    body = {"model": MODEL, "prompt": "a", "max_tokens": 4000, "ignore_eos": True, "stream": True}
    began = time.monotonic()
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=120) as response:
        lines = [line for line in sse_lines(response) if line]
        took = time.monotonic() - began
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2].removeprefix("data: "))["choices"][0]["finish_reason"] == "length"
    assert took > 3 * TIMEOUT_S, "the stream was too short to show anything"


def test_ordinary_requests_are_untouched(server):
    with httpx.Client(base_url=server.url, timeout=60) as client:
        for _ in range(3):  # one keep-alive connection, requests well within the deadlines
            response = client.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
            assert response.status_code == 200
            time.sleep(TIMEOUT_S / 2)
