"""A real `tinyserve serve` on a free loopback port, started from outside: for tests, benchmarks and scripts.

    server = ServerProcess("/path/to/model", "--served-model-name", "tiny")  # returns once /health answers
    httpx.get(f"{server.url}/v1/models")
    log = server.stop()                                                      # SIGTERM, wait, all it printed

    router = NginxRouter("/usr/sbin/nginx", [server_a.port, server_b.port], folder)  # least_conn in front
    router.url, router.stop()

    router = RouterProcess([server_a.url, server_b.url], "--policy", "least_load")  # `tinyserve router`

The test suite, benchmarks/soak.py and scripts/record_traces.py start their servers
(and the nginx in front of several) with these helpers. It lives in the package rather than in tests/ so that all three
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

    def __init__(self, model: str | None, *flags: str, startup_timeout: float = 300.0, env: dict | None = None,
                 log_path: str | Path | None = None) -> None:
        """model: a model folder, or None for the built-in model.
        startup_timeout: generous, for a busy 2-core machine (a start takes 8-20 s on an idle one; a server that
        exits instead of answering fails at once).
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


class RouterProcess(ServerProcess):
    """`python -m tinyserve.cli.main router --backend URL... --port <free port> FLAGS...`, healthy once
    constructed (its /health answers 200 once a backend does)."""

    def __init__(self, backends: list[str], *flags: str, startup_timeout: float = 300.0,
                 log_path: str | Path | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.killed = False
        command = [sys.executable, "-m", "tinyserve.cli.main", "router", "--port", str(self.port),
                   *(["--backend", *backends] if backends else []), *flags]  # none: the flags name them
        self.log = open(log_path, "w+b") if log_path is not None else tempfile.TemporaryFile()
        self.process = subprocess.Popen(command, env=dict(os.environ, PYTHONUNBUFFERED="1"),
                                        stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        self._wait_healthy(startup_timeout)


# The temporary files nginx may write, all under one folder: it need not run as root.
NGINX_CONFIG = """daemon off;
worker_processes 1;
pid {folder}/nginx.pid;
error_log {folder}/error.log;
events {{ worker_connections 256; }}
http {{
    access_log {folder}/access.log;
    client_body_temp_path {folder}/client_body;
    proxy_temp_path {folder}/proxy;
    fastcgi_temp_path {folder}/fastcgi;
    uwsgi_temp_path {folder}/uwsgi;
    scgi_temp_path {folder}/scgi;
    upstream tinyserve {{
        least_conn;
{servers}
    }}
    server {{
        listen 127.0.0.1:{port};
        location / {{
            proxy_pass http://tinyserve;
            proxy_http_version 1.1;
            proxy_buffering off;
            proxy_read_timeout 300s;
        }}
    }}
}}
"""


class NginxRouter:
    """nginx on a free loopback port in front of servers on loopback ports, `least_conn`: each new
    request goes to the server with the fewest open requests (vLLM's external load balancing, a
    router of one's own in front of --data-parallel-rank servers). Healthy once constructed."""

    def __init__(self, binary: str, ports: list[int], folder: str | Path, timeout: float = 30.0) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        servers = "\n".join(f"        server 127.0.0.1:{port};" for port in ports)
        config = self.folder / "nginx.conf"
        config.write_text(NGINX_CONFIG.format(folder=self.folder, port=self.port, servers=servers))
        # -e: the error log from the start, before the config is read (the default is under /var/log).
        self.process = subprocess.Popen([binary, "-p", str(self.folder), "-c", str(config),
                                         "-e", str(self.folder / "error.log")],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while not self._answers():
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"nginx did not answer /health within {timeout:.0f} s")
            time.sleep(0.1)

    def _answers(self) -> bool:
        if self.process.poll() is not None:
            raise RuntimeError(f"nginx exited with {self.process.returncode}: {self.error_log()[-3000:]}")
        try:
            return httpx.get(f"{self.url}/health", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    def error_log(self) -> str:
        path = self.folder / "error.log"
        return path.read_text() if path.exists() else ""

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            self.process.wait(30)
