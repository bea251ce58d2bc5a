"""Small helpers both processes use; plain Python, importing nothing of tinyserve."""

import contextlib
import signal
import threading


def cdiv(a: int, b: int) -> int:
    """Ceiling division: how many blocks of size b hold a items."""
    return -(-a // b)


@contextlib.contextmanager
def sigint_ignored():
    """Start a child process with SIGINT ignored from its first instruction.

    A Ctrl-C in a terminal sends SIGINT to the whole foreground process group, engines and
    tensor-parallel ranks included; the API process alone decides how they stop (SIGTERM,
    after the drain). A child sets SIGINT to SIG_IGN itself, but only once its imports are
    done, seconds after it starts; a disposition of SIG_IGN survives exec, and Python then
    installs no KeyboardInterrupt handler of its own, so the child ignores it from the start.
    """
    if threading.current_thread() is not threading.main_thread():  # signal.signal works there only
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
