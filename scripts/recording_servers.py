"""The servers a recording runs against (scripts/record_traces.py): one, or a scale-out deployment.

    one server          tinyserve serve --trace FLAGS                     → its run folder
    head + headless     tinyserve serve --trace FLAGS (the head)          → both folders, merged
                        tinyserve serve --headless --trace NODE_FLAGS       (trace_reading/merge.py)
    ranks behind nginx  tinyserve serve --trace FLAGS --data-parallel-rank R, for each R,
                        and nginx (least_conn) in front                   → every rank's folder, merged
    ranks behind the    the same ranks, and `tinyserve router --trace ROUTER_FLAGS` in front
      router                                                              → the router's and the ranks' folders, merged
    prefill + decode    tinyserve serve --trace FLAGS --kv-transfer-config kv_producer, and
                        the same with kv_consumer, `tinyserve router --trace --prefill --decode`
                        in front                                          → the router's and the decode
                                                                            server's folders, merged (the
                                                                            prefill server's kept beside)

Every process traces into a folder of its own under the scratch directory; `run_folder`
turns what they wrote into the one run folder the notebooks load. Each is stopped with
SIGTERM, so that it drains and flushes its spans; a headless node stops when its head does.
"""

import concurrent.futures
import contextlib
import json
import os
import secrets
import signal
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from a checkout that is not pip-installed
    sys.path.insert(0, str(ROOT))

from tinyserve.testing import NginxRouter, RouterProcess, ServerProcess  # noqa: E402

# One torch thread per process: a 4M-parameter model gains nothing from more, and on a
# machine with few cores, threads of several processes spinning against each other
# make steps ten times slower or worse, and the timings erratic.
SERVER_ENV = {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
NODE_STOP_TIMEOUT_S = 60
# A head and a headless node recorded on one machine: the host names their spans carry
HEAD_HOST, NODE_HOST = "head", "node-1"


def server_env(host_name: str | None = None) -> dict:
    """host_name: the host.name its spans carry (OpenTelemetry's OTEL_RESOURCE_ATTRIBUTES), when one machine
    plays several hosts; else the machine's own."""
    env = {**SERVER_ENV, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    if host_name is not None:
        env["OTEL_RESOURCE_ATTRIBUTES"] = f"host.name={host_name}"
    return env


def start_server(trace_dir: Path, flags: list[str], host_name: str | None = None,
                 env: dict | None = None) -> ServerProcess:
    """`tinyserve serve --trace` on the built-in model, in a process group of its own; returns once /health answers.
    env: variables of its own, beside server_env's."""
    return ServerProcess(None, "--trace", "--trace-dir", str(trace_dir), *flags, startup_timeout=300,
                         env={**server_env(host_name), **(env or {})})


def stop_server(server: ServerProcess) -> None:
    """SIGTERM: the server drains, the engines flush their spans, then the API process flushes its own."""
    server.stop(timeout=60)
    if server.killed:
        raise RuntimeError("the server did not stop on SIGTERM; its spans may be incomplete")


@contextlib.contextmanager
def deployment(scratch: Path, flags: list[str], headless_flags: list[str] | None = None, routed_ranks: int = 0,
               router: list[str] | None = None, disaggregated: bool = False):
    """Yield (the URL to send the workload to, a function that kills the headless node, or None, the URL of each
    rank's server behind the router or nginx, or []), with every process tracing under scratch/; stop them all
    after (a node killed on purpose is not waited for).
    router: the ranks are behind `tinyserve router` with these flags instead of nginx.
    disaggregated: a prefill server and a decode server behind `tinyserve router --prefill --decode`."""
    if routed_ranks or disaggregated:
        if disaggregated:
            with prefill_decode(scratch, flags) as url:
                yield url, None, []
            return
        with routed(scratch, flags, routed_ranks, router) as (url, backends):
            yield url, None, backends
        return
    node = None
    if headless_flags is not None:  # first: the head answers /health only once the node's ranks are ready
        log = open(scratch / "headless.log", "wb")
        command = [sys.executable, "-m", "tinyserve.cli.main", "serve", "--headless", "--trace",
                   "--trace-dir", str(scratch / "node"), *headless_flags]
        node = subprocess.Popen(command, env=dict(os.environ, **server_env(NODE_HOST)), stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    killed = []

    def kill_node() -> None:  # SIGKILL, as a machine that loses power: nothing flushed, nothing said
        killed.append(True)
        os.killpg(node.pid, signal.SIGKILL)

    try:
        server = start_server(scratch / "traces", flags, HEAD_HOST if headless_flags is not None else None)
        try:
            yield server.url, (kill_node if node is not None else None), []
        finally:
            stop_server(server)
    finally:
        if node is not None and killed:
            node.wait(NODE_STOP_TIMEOUT_S)
        elif node is not None:
            try:
                code = node.wait(NODE_STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                node.kill()
                raise RuntimeError("the headless node did not stop with its head") from None
            if code != 0:
                raise RuntimeError(f"the headless node exited with {code}: {(scratch / 'headless.log').read_text()[-3000:]}")


@contextlib.contextmanager
def routed(scratch: Path, flags: list[str], num_ranks: int, router: list[str] | None = None):
    """One server per rank (--data-parallel-rank R), each tracing into scratch/rank-R, and nginx in front
    (or `tinyserve router ROUTER_FLAGS`, tracing into scratch/router). Yields (the front's URL, each rank's)."""
    binary = shutil.which("nginx") or shutil.which("nginx", path="/usr/sbin:/sbin")
    if binary is None and router is None:
        raise RuntimeError("recording behind a router needs nginx (Debian: apt-get install nginx)")
    rank_flags = [[*flags, "--data-parallel-size", str(num_ranks), "--data-parallel-rank", str(rank)]
                  for rank in range(num_ranks)]
    with concurrent.futures.ThreadPoolExecutor(num_ranks) as pool:  # each loads its model: start them together
        servers = list(pool.map(lambda rank: start_server(scratch / f"rank-{rank}", rank_flags[rank]), range(num_ranks)))
    try:
        if router is None:
            front = NginxRouter(binary, [server.port for server in servers], scratch / "nginx")
        else:
            front = RouterProcess([server.url for server in servers], "--trace", "--trace-dir", str(scratch / "router"),
                                  *router)
        try:
            yield front.url, [server.url for server in servers]
        finally:
            front.stop()
    finally:
        for server in servers:
            stop_server(server)


PD_ROLES = {"prefill": "kv_producer", "decode": "kv_consumer"}


@contextlib.contextmanager
def prefill_decode(scratch: Path, flags: list[str]):
    """A prefill server and a decode server (--kv-transfer-config), tracing into scratch/prefill and
    scratch/decode, and `tinyserve router --prefill URL --decode URL` in front (disaggregated prefill),
    tracing into scratch/router: its spans are the parents of both legs, so one trace holds all three. The
    two servers share a secret made for the recording (TINYSERVE_KV_TRANSFER_SECRET: they are peers)."""
    secret = {"TINYSERVE_KV_TRANSFER_SECRET": secrets.token_hex(16)}
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        servers = list(pool.map(lambda role: start_server(scratch / role, [
            *flags, "--kv-transfer-config", json.dumps({"kv_role": PD_ROLES[role]})], env=secret), PD_ROLES))
    try:
        router = RouterProcess([], "--trace", "--trace-dir", str(scratch / "router"), "--prefill", servers[0].url,
                               "--decode", servers[1].url)
        try:
            yield router.url
        finally:
            router.stop()
    finally:
        for server in servers:
            stop_server(server)


def run_folder(scratch: Path) -> Path:
    """The recording's one run folder: the server's, or those of a head and its node (or of every rank) merged."""
    from tinyserve.trace_reading.merge import merge_runs

    if (scratch / "decode").exists():  # disaggregated: the decode server's run holds every request's tokens
        return merge_runs([*sorted(scratch.glob("router/*")), next((scratch / "decode").iterdir())], scratch / "merged")
    folders = [*sorted(scratch.glob("router/*")), *sorted(scratch.glob("rank-*/*"))] or \
        [*(scratch / "traces").iterdir(), *(scratch / "node").glob("*")]
    return folders[0] if len(folders) == 1 else merge_runs(folders, scratch / "merged")
