"""A real `tinyserve serve` on a free loopback port, started from outside: for tests, benchmarks and scripts.

    server = ServerProcess("/path/to/model", "--served-model-name", "tiny")  # returns once /health answers
    httpx.get(f"{server.url}/v1/models")
    log = server.stop()                                                      # SIGTERM, wait, all it printed

The test suite, benchmarks/soak.py and scripts/record_traces.py start their servers
with this one helper. It lives in the package rather than in tests/ so that all three
import it the same way, wherever tinyserve is installed: a script in benchmarks/ or
scripts/ cannot import tests/ without editing sys.path, and a test module should not
import another test module. Nothing on tinyserve's own serving path imports it (as
with numpy.testing): it is for whoever drives a server from the outside.

The server is a subprocess that leads its own process group (so that one can check
nothing of it outlives it), with its output in a file rather than a pipe (a pipe
nobody reads would stall a chatty server).
"""

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx


def free_port() -> int:
    """A loopback port nobody listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`python -m tinyserve.cli.main serve [MODEL] --port <free port> FLAGS...`, healthy once constructed."""

    def __init__(self, model: str | None, *flags: str, startup_timeout: float = 120.0, env: dict | None = None,
                 log_path: str | Path | None = None) -> None:
        """model: a model folder, or None for the built-in model.
        env: variables added to this process's environment (TMPDIR, say, to watch the server's temp files).
        log_path: where its output goes (default: a temporary file, gone with this object).
        """
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.killed = False  # set when stop() had to SIGKILL the group
        command = [sys.executable, "-m", "tinyserve.cli.main", "serve", *([model] if model else []),
                   "--port", str(self.port), *flags]
        self.log = open(log_path, "w+b") if log_path is not None else tempfile.TemporaryFile()
        self.process = subprocess.Popen(command, env=dict(os.environ, PYTHONUNBUFFERED="1", **(env or {})),
                                        stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        self._wait_healthy(startup_timeout)

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited with {self.process.returncode}:\n{self.output()[-5000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        output = self.stop()
        raise RuntimeError(f"the server did not answer /health within {timeout:.0f} s:\n{output[-5000:]}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> str:
        """Signal the server, wait for it to exit (SIGKILL its group after `timeout` s), return all it printed."""
        if self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
                self.killed = True
        return self.output()

    def output(self) -> str:
        """Everything the server has printed so far."""
        # pread leaves the file offset alone: the server shares it, and writes at it.
        chunks, offset = [], 0
        while chunk := os.pread(self.log.fileno(), 1 << 20, offset):
            chunks.append(chunk)
            offset += len(chunk)
        return b"".join(chunks).decode(errors="replace")

    @property
    def pgid(self) -> int:
        """The server's process group: the API process and every engine it started."""
        return self.process.pid  # start_new_session: the server leads its own group

    def group_is_gone(self) -> bool:
        """True once no process of the server's group is left (zombies included: they hold a pid)."""
        try:
            os.killpg(self.pgid, 0)
        except ProcessLookupError:
            return True
        return False
