"""Helpers for tests that watch a real server from outside: its Prometheus metrics, and waiting on a condition."""

import os
import re
import time

import httpx

from tests.patience import patient
from tests.tiny_checkpoints import tiny_model_with_tokenizer


def long_context_model() -> str:
    return str(tiny_model_with_tokenizer("llama", max_position_embeddings=8192))


def metric(url: str, name: str) -> float:
    """The sum of tinyserve:<name> over its label sets, as /metrics reports it now."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(float(m.group(1)) for m in re.finditer(rf"^tinyserve:{name}\{{[^}}]*\}} (\S+)$", text, re.MULTILINE))


def wait_until(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + patient(timeout)
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.1)


def sse_lines(response):
    """The lines of a streamed (SSE) response, as the protocol splits them: at LF, CRLF or CR only.

    httpx's iter_lines also splits at U+2028, U+0085 and the other Unicode line breaks, which a
    sampled token's text may hold inside a JSON string: a chunk would arrive cut in two."""
    pending = b""
    for data in response.iter_bytes():
        pending += data
        *lines, pending = re.split(rb"\r\n|\r|\n", pending)
        yield from (line.decode() for line in lines)
    if pending:
        yield pending.decode()


TOKEN_CHUNK = re.compile(r'"finish_reason":\s*null')


def is_token_chunk(line: str) -> bool:
    """A streamed completion's chunk that carries tokens and nothing more: no error, no finish, no usage.

    Read without parsing the JSON: a test's threads reading thousands of chunks a second would
    otherwise starve its main thread (the GIL) of the time to watch them."""
    return line.startswith("data: {") and '"error"' not in line and TOKEN_CHUNK.search(line) is not None \
        and '"usage":{' not in line.replace(" ", "")


def group_is_gone(pgid: int) -> bool:
    """No process of the group `pgid` is left (a server started in a session of its own, and its children)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    return False
