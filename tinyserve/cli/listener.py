"""The server's listening socket, bound before anything slow starts, and the flags that bound what arrives on it
(`tinyserve serve` and `tinyserve router` take the same ones)."""

import socket

from tinyserve.entrypoints.api.defaults import (
    DEFAULT_BODY_TIMEOUT_S,
    DEFAULT_HEADER_TIMEOUT_S,
    DEFAULT_KEEP_ALIVE_S,
    DEFAULT_MAX_REQUEST_BODY_BYTES,
)


def add_connection_limit_flags(limits) -> None:
    """A request's body size, the time its headers and its body may take, and an idle connection's life."""
    limits.add_argument("--max-request-body-bytes", type=int, default=DEFAULT_MAX_REQUEST_BODY_BYTES,
                        help="largest request body accepted; larger ones get 413, counted while reading "
                             "(default %(default)s)")
    limits.add_argument("--http-header-timeout", type=float, default=DEFAULT_HEADER_TIMEOUT_S,
                        help="seconds a request's line and headers may take to arrive, from the connection "
                             "opening or the previous response; then 408 and the connection is closed "
                             "(default %(default)s)")
    limits.add_argument("--http-body-timeout", type=float, default=DEFAULT_BODY_TIMEOUT_S,
                        help="seconds a request's body may take to arrive after its headers; then 408 and the "
                             "connection is closed (default %(default)s)")
    limits.add_argument("--timeout-keep-alive", type=float, default=DEFAULT_KEEP_ALIVE_S,
                        help="seconds an idle keep-alive connection stays open (uvicorn's, default %(default)s)")


def bind_listener(host: str, port: int) -> socket.socket:
    """The listening socket, bound before the model loads (as vLLM does): a taken port or an
    unknown host is reported at once instead of after a long start-up. uvicorn serves on it.

    The protocol is named (IPPROTO_TCP, not 0): asyncio turns Nagle's algorithm off only on
    connections whose socket says TCP. With it on, a response's body, written after its
    headers, waited for the client's delayed ACK of them: 40 ms more for every response.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((host, port))
    except OSError:
        listener.close()
        raise
    return listener
