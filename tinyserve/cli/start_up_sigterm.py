"""SIGTERM while `tinyserve serve` starts: before the server's own handler (guards/shutdown.py) takes over.

Python's default would end the process at once: the engines launched so far would be left to notice
their parent's death, and the socket directory behind. `exit_on_sigterm` raises SystemExit instead,
which unwinds as Ctrl-C does, and MPClient's exit hook stops them. It is raised wherever the main
thread is, and an import there (a library's bare `except:`) once swallowed it: the server then
started and never stopped. So the handler also records the signal, and `exit_if_sigterm_received`
raises SystemExit again just before the server's own handler is installed.
"""

import threading

received = threading.Event()


def exit_on_sigterm(signum, frame) -> None:
    received.set()
    raise SystemExit(0)


def exit_if_sigterm_received() -> None:
    if received.is_set():
        raise SystemExit(0)
