"""Start a real `tinyserve serve` process on a free loopback port, for tests."""

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, model: str, *flags: str, startup_timeout: float = 120.0, env: dict | None = None) -> None:
        """env: variables to add to this process's environment (TMPDIR, say, to watch its temp files)."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        command = [sys.executable, "-m", "tinyserve.cli.main", "serve", model, "--port", str(self.port), *flags]
        env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
        # Output goes to a file, not a pipe: a pipe nobody reads would stall a chatty server.
        self.log = tempfile.TemporaryFile(mode="w+")
        # Its own process group, so a test can check that nothing of the server is left behind.
        self.process = subprocess.Popen(command, env=env, stdout=self.log, stderr=subprocess.STDOUT,
                                        text=True, start_new_session=True)
        self._wait_healthy(startup_timeout)

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited with {self.process.returncode}:\n{self.output()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        self.stop()
        raise RuntimeError("server did not become healthy in time")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> str:
        """Signal the server, wait for it to exit, and return everything it printed."""
        if self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        return self.output()

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read()

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
