"""Child processes (engines, tensor-parallel ranks) that never import the caller's `__main__`.

multiprocessing's "spawn" starts a fresh interpreter that first imports the parent's main
module again, so that functions defined there can be unpickled. A user's script that
makes an `LLM` or an `AsyncLLM` at module level, with no `if __name__ == "__main__":`
guard, then starts the engine a second time inside the engine process, and
multiprocessing stops it with "An attempt has been made to start a new process before
the current process has finished its bootstrapping phase".

Here the child is `python -m tinyserve.engine.child_process`: its main module is this
one. The parent pickles the entry point and its arguments onto the child's standard
input, a pipe only the two processes hold, and the child calls it. As spawn does, the
child takes the parent's `sys.path` first, so what the parent imports it imports too.

`ChildProcess` keeps the part of `multiprocessing.Process` its callers use: `pid`,
`exitcode` (negative: killed by that signal), `join`, `terminate`, `kill`, and a
`sentinel` file descriptor that becomes readable when the child exits, for an event
loop's `add_reader` (a pidfd; a pipe where the system has none). Children still running
when the parent's interpreter exits are ended, as multiprocessing ends its `daemon=True`
ones.
"""

import atexit
import contextlib
import os
import pickle
import subprocess
import sys
import weakref
from collections.abc import Callable
from pathlib import Path

_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])  # the folder that holds tinyserve/
_STOP_TIMEOUT_S = 5.0  # at interpreter exit: SIGTERM, then SIGKILL after this long
_running: "weakref.WeakSet[ChildProcess]" = weakref.WeakSet()


class ChildProcess:
    """target(**kwargs) in a new interpreter whose main module is this one."""

    def __init__(self, target: Callable, kwargs: dict, name: str, pass_fds: tuple[int, ...] = ()) -> None:
        """pass_fds: file descriptors the child inherits, at the same numbers (a listening socket, say)."""
        self.name = name
        self.pass_fds = tuple(pass_fds)
        self._payload = (target, kwargs)
        self._popen: subprocess.Popen | None = None
        self.sentinel: int | None = None

    def start(self) -> None:
        env = dict(os.environ)
        # The child must find this module before it can read the parent's sys.path.
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_PACKAGE_ROOT, env.get("PYTHONPATH")) if p)
        if hasattr(os, "pidfd_open"):  # Linux: a descriptor of the process itself
            self._popen = subprocess.Popen([sys.executable, "-m", __name__], stdin=subprocess.PIPE, env=env,
                                           pass_fds=self.pass_fds)
            self.sentinel = os.pidfd_open(self._popen.pid)
        else:  # elsewhere: a pipe whose write end only the child holds, at EOF once it has exited
            self.sentinel, write_end = os.pipe()
            try:
                self._popen = subprocess.Popen([sys.executable, "-m", __name__], stdin=subprocess.PIPE, env=env,
                                               pass_fds=(write_end, *self.pass_fds))
            finally:
                os.close(write_end)
        weakref.finalize(self, os.close, self.sentinel)
        _running.add(self)
        try:
            # Two pickles: the path first, so that the second finds every module it names.
            pickle.dump((self.name, sys.path), self._popen.stdin)
            pickle.dump(self._payload, self._popen.stdin, protocol=pickle.HIGHEST_PROTOCOL)
        except BrokenPipeError:  # it died before it read them: exitcode says how
            pass
        finally:  # the child then reads to the end, and exits if it got less than it needs
            with contextlib.suppress(BrokenPipeError):
                self._popen.stdin.close()

    @property
    def pid(self) -> int | None:
        return None if self._popen is None else self._popen.pid

    @property
    def exitcode(self) -> int | None:
        """None while it runs; its exit status once it has ended (-N: killed by signal N)."""
        return None if self._popen is None else self._popen.poll()

    def is_alive(self) -> bool:
        return self._popen is not None and self._popen.poll() is None

    def join(self, timeout: float | None = None) -> None:
        """Wait until it ends, or timeout seconds."""
        if self._popen is None:
            return
        try:
            self._popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    def terminate(self) -> None:
        if self.is_alive():
            self._popen.terminate()

    def kill(self) -> None:
        if self.is_alive():
            self._popen.kill()


@atexit.register
def _stop_children() -> None:
    """What multiprocessing does for daemon processes: the parent's exit ends them."""
    children = [child for child in _running if child.is_alive()]
    for child in children:
        child.terminate()
    for child in children:
        child.join(_STOP_TIMEOUT_S)
        child.kill()


def _main() -> None:
    import multiprocessing

    try:
        name, path = pickle.load(sys.stdin.buffer)
        sys.path[:] = path
        multiprocessing.current_process().name = name  # for logging's %(processName)s
        target, kwargs = pickle.load(sys.stdin.buffer)
    except EOFError:  # the parent stopped (a SIGTERM during start-up) before it sent this process its work
        sys.exit(0)
    sys.stdin.close()
    target(**kwargs)


if __name__ == "__main__":
    _main()
