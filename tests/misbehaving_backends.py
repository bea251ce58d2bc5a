"""HTTP backends that misbehave, for the router's tests: real servers on loopback ports, each on a thread.

Each is a bare asyncio HTTP/1.1 server (keep-alive, Content-Length bodies) whose answers are written
byte for byte, so that it can do what a well-behaved server never does: take a connection and never
answer, report a load of NaN, or go away in the middle of an answer.

    backend = FakeBackend(silent)                 # accepts connections, never answers anything
    backend = FakeBackend(answers_health_only)    # /health 200; a generation request is never answered
    backend = FakeBackend(reports_load(header))   # /health 200; every request answered, with this ORCA header
    backend = FakeBackend(drops_mid_answer)       # /health 200; answers begin, then the connection is dropped
    backend.url, backend.posts() (the JSON bodies it was sent), backend.stop()
"""

import asyncio
import json
import threading

FAKE_TEXT = "from a fake backend"
COMPLETION = {"id": "cmpl-fake", "object": "text_completion", "created": 0, "model": "fake",
              "choices": [{"index": 0, "text": FAKE_TEXT, "finish_reason": "stop", "logprobs": None}],
              "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}


class FakeBackend:
    def __init__(self, answer) -> None:
        """answer: async (writer, method, path, body) -> bool, whether the connection may take another request."""
        self.answer = answer
        self.requests: list[tuple[str, str, bytes]] = []  # (method, path, body), as they arrived
        self.loop = asyncio.new_event_loop()
        started = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(started,), daemon=True)
        self.thread.start()
        assert started.wait(30), "the fake backend did not start"

    def _run(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        self.server = self.loop.run_until_complete(asyncio.start_server(self._connection, "127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        started.set()
        self.loop.run_forever()

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
                method, path, _ = head[0].split(" ", 2)
                headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in head[1:])}
                body = await reader.readexactly(int(headers.get("content-length", "0")))
                self.requests.append((method, path, body))
                if not await self.answer(writer, method, path, body):
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    def posts(self) -> list[dict]:
        """The JSON bodies of the POSTs it was sent."""
        return [json.loads(body) for method, _, body in list(self.requests) if method == "POST"]

    def stop(self) -> None:
        """Close the listener and every connection, then the loop."""
        async def close_all():
            self.server.close()
            handlers = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
            for task in handlers:
                task.cancel()
            await asyncio.gather(*handlers, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(close_all(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)
        self.loop.close()


async def respond(writer, status: int, body: bytes, headers: dict | None = None) -> bool:
    lines = [f"HTTP/1.1 {status} X", "content-type: application/json", f"content-length: {len(body)}",
             *(f"{k}: {v}" for k, v in (headers or {}).items())]
    writer.write("\r\n".join(lines).encode() + b"\r\n\r\n" + body)
    await writer.drain()
    return True


async def silent(writer, method, path, body) -> bool:
    await asyncio.Event().wait()  # for ever


async def answers_health_only(writer, method, path, body) -> bool:
    if path == "/health":
        return await respond(writer, 200, b"")
    return await silent(writer, method, path, body)


def reports_load(orca_header: str):
    async def answer(writer, method, path, body) -> bool:
        if path == "/health":
            return await respond(writer, 200, b"")
        return await respond(writer, 200, json.dumps(COMPLETION).encode(), {"endpoint-load-metrics": orca_header})

    return answer


async def drops_mid_answer(writer, method, path, body) -> bool:
    """A stream: one whole event and half of the next; a whole answer: 10 of its 1000 bytes; /v1/models:
    64 MB (as a chunked body); then the connection is closed."""
    if path == "/health":
        return await respond(writer, 200, b"")
    if path == "/v1/models":
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n")
        chunk = b"x" * (1 << 20)
        for _ in range(64):
            writer.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            await writer.drain()
        writer.write(b"0\r\n\r\n")
        return True
    if json.loads(body).get("stream"):
        event = json.dumps({**COMPLETION, "object": "text_completion"})
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        data = f"data: {event}\n\ndata: {event[:20]}".encode()
        writer.write(b"%x\r\n%s\r\n" % (len(data), data))
    else:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 1000\r\n\r\n"
                     + json.dumps(COMPLETION).encode()[:10])
    await writer.drain()
    return False
