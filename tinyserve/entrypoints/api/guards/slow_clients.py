"""Slow clients: a deadline for each request's headers and for its body (stage ①, before the app).

uvicorn waits for as long as it takes for a request to arrive. A client that
opens a connection and sends its headers a byte at a time (slowloris) holds
that connection for ever, and one that never finishes its body holds the
handler reading it. So each request gets deadlines, kept by the connection's
protocol (uvicorn's HTTP/1.1 one, with timers added):

    connection opened, or the first byte of the next request on a kept-alive one
      │ request line and headers, whole, within --http-header-timeout
      │   (a kept-alive connection that sends nothing is closed after uvicorn's
      │    --timeout-keep-alive of 5 s, as in vLLM; a new one after the header timeout)
      │ the body, whole, within --http-body-timeout of its headers
      ▼ the app has the request; a deadline missed answers 408 (if a request had
        begun) and closes the connection

h11 already bounds the headers' size (16 KiB), so a deadline bounds all a slow
client can hold. The timers only watch the request's arrival: a response may
stream for as long as generation takes.
"""

import asyncio
import json

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from tinyserve.entrypoints.api.errors import anthropic_error_body, is_anthropic_path, openai_error_body

from tinyserve.entrypoints.api.defaults import DEFAULT_BODY_TIMEOUT_S, DEFAULT_HEADER_TIMEOUT_S  # the CLI's too


def request_timeout(path: str | None, message: str) -> bytes:
    """A whole 408 response, written straight to the socket: no request (or none whole) reached h11's state for one."""
    body = anthropic_error_body(408, message) if path and is_anthropic_path(path) else openai_error_body(408, message)
    content = json.dumps(body).encode()
    return (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
            b"content-length: %d\r\n\r\n%s" % (len(content), content))


class DeadlineProtocol(H11Protocol):
    """uvicorn's HTTP/1.1 protocol, with a deadline for each request's headers and one for its body."""

    header_timeout: float = DEFAULT_HEADER_TIMEOUT_S
    body_timeout: float = DEFAULT_BODY_TIMEOUT_S

    @classmethod
    def with_timeouts(cls, header_timeout: float, body_timeout: float) -> type["DeadlineProtocol"]:
        """The protocol class uvicorn is given (`Config(http=...)`), with these deadlines in seconds."""
        if header_timeout <= 0 or body_timeout <= 0:
            raise ValueError(f"timeouts must be positive, got {header_timeout} and {body_timeout}")
        return type(cls.__name__, (cls,), {"header_timeout": header_timeout, "body_timeout": body_timeout})

    def connection_made(self, transport: asyncio.Transport) -> None:
        self._deadline: asyncio.TimerHandle | None = None
        self._waiting_for: str | None = None
        self._started = False  # some bytes of the awaited request have arrived
        super().connection_made(transport)
        self._arm("headers")  # a new connection has no keep-alive timer: this is its idle limit too

    def data_received(self, data: bytes) -> None:
        if self.conn.their_state is h11.IDLE:
            self._started = True
            if self._waiting_for is None:  # the first bytes on a kept-alive connection: its next request
                self._arm("headers")
        super().data_received(data)

    def on_response_complete(self) -> None:
        super().on_response_complete()  # arms uvicorn's keep-alive timer for an idle connection
        if self.conn.their_state is h11.IDLE and self.conn.trailing_data[0] and self._waiting_for is None:
            self._started = True  # part of a pipelined request, already buffered
            self._arm("headers")

    def handle_events(self) -> None:
        super().handle_events()
        state = self.conn.their_state
        if state is h11.IDLE:
            return
        self._started = False
        if state is h11.SEND_BODY:
            if self._waiting_for != "body":
                self._arm("body")
        else:  # the request is whole (or the connection is ending)
            self._disarm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self, waiting_for: str) -> None:
        self._disarm()
        if self.transport.is_closing():
            return
        timeout = self.header_timeout if waiting_for == "headers" else self.body_timeout
        self._waiting_for = waiting_for
        self._deadline = self.loop.call_later(timeout, self._expired, waiting_for, timeout)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        self._deadline, self._waiting_for = None, None

    def _expired(self, waiting_for: str, timeout: float) -> None:
        self._deadline, self._waiting_for = None, None
        if self.transport.is_closing():
            return
        flag = "--http-header-timeout" if waiting_for == "headers" else "--http-body-timeout"
        message = f"the request's {waiting_for} did not arrive within {timeout:g} s ({flag})"
        self.logger.warning("closing a connection from %s: %s", self.client, message)
        if waiting_for == "headers":
            if self._started:  # nothing to answer a connection that never began a request
                self.transport.write(request_timeout(None, message))
        elif not self.cycle.response_started:  # the app may have answered without reading the body
            self.transport.write(request_timeout(self.scope["path"], message))
        self.transport.close()
