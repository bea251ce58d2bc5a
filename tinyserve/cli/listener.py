"""The server's listening socket, bound before anything slow starts."""

import socket


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
