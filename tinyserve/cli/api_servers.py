"""Several API processes on one port: `tinyserve serve --api-server-count N` (vLLM's `-asc`).

One Python event loop parses every request, tokenizes it (in threads that still share one
GIL), detokenizes every token of every stream and frames every SSE chunk. Past some
request rate that loop, not the engines, is what requests wait for. N API processes
share that work; each is a whole front end (AsyncLLM, detokenizer, HTTP server) and a
client of every engine:

    main process (this module)        binds the port, starts engines and API processes, watches them
      ├── engine 0 .. D-1             one PULL from every API process, one PUSH to each (wire/ipc.py)
      ├── API process 0               client_index 0 of N (frontend/api_server_client.py)
      ├── ...
      └── API process N-1

The port: the main process binds the listening socket and every API process inherits
it (pass_fds) and accepts on it, as vLLM passes its socket to each API server. The
alternative, SO_REUSEPORT with a socket per process, lets the kernel hash each
connection to one process's own queue by its addresses, whether that process is busy or
not, and lets any process of the same user bind the port too; one shared queue is drained
by whichever process calls accept first, so a busy one takes fewer, and `--port 0` names
one port for all.

An output finds its API process because the request carries `client_index`, and the
engine keeps one output socket per API process (engine/client_outputs.py). Engine load is
shared without a coordinator: every engine sends its stats to every API process every
step, so each one's least-loaded choice (frontend/dp_client.py) reads the same reports;
what one cannot see is the requests the others sent since the last report, one step's.

What each process reports: /metrics, whichever process answers, sums every process's
counters and histograms (prometheus-client's multiprocess mode, in PROMETHEUS_MULTIPROC_DIR,
made here unless set; entrypoints/api/metrics.py). The ORCA headers read the engines'
stats, which every process has. /load counts the generation requests in flight in the
process that answers it (vLLM's too). --max-waiting-requests is checked by each process on its
own unfinished requests less every engine's running ones: looser, by the others' running ones.
With --trace each process writes api-<i>.jsonl (service tinyserve-api-<i>) beside the
engines' files, and load_run reads them all.

Lifetimes: SIGTERM (or Ctrl-C) to the main process is passed to every API process, which
drains as a lone server does; then the engines stop. An API process that exits on its own
(killed, crashed, or stopping for an engine's death) stops the others, which drain, and the
server exits with status 1; so does an engine's death, unless --keep-alive-on-engine-death.
"""

import argparse
import logging
import os
import select
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time

logger = logging.getLogger("tinyserve.api_servers")

MULTIPROC_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"  # prometheus-client's variable, which vLLM uses too
_POLL_S = 0.5
_STOP_GRACE_S = 15.0  # past --shutdown-timeout and the abort's grace, an API process still there is killed


def add_api_server_flags(group) -> None:
    group.add_argument("--api-server-count", "-asc", type=int, default=1,
                       help="API processes serving the port, each a client of every engine: tokenizing, "
                            "detokenizing and streaming spread over that many event loops (default 1)")


def check_api_server_flags(args: argparse.Namespace) -> str | None:
    count = args.api_server_count
    if count < 1:
        return f"--api-server-count must be at least 1, got {count}"
    if count == 1:
        return None
    if args.headless:
        return "--api-server-count is for the node that serves the API; a --headless node serves none"
    if args.data_parallel_rank is not None:
        return "--api-server-count > 1 needs the engines started here, not one --data-parallel-rank"
    if args.data_parallel_size_local not in (None, args.data_parallel_size):
        return "--api-server-count > 1 needs every engine on this node (no --data-parallel-size-local)"
    if getattr(args, "data_parallel_backend", None) == "ray":
        return "--api-server-count > 1 starts the engines as processes of its own, not with --data-parallel-backend ray"
    return None


def run_api_servers(args: argparse.Namespace, listener: socket.socket, served_model_name: str, serve_api) -> int:
    """The main process: engines and N API processes started, watched and stopped; the exit status.

    serve_api: cli/serve.py's, which each API process runs (serve.py imports this module, not the reverse).
    """
    from tinyserve.assemble import build_engine_core
    from tinyserve.cli.engine_flags import engine_args_from
    from tinyserve.cli.trace_setup import start_tracing
    from tinyserve.config import ModelInfo
    from tinyserve.engine.child_process import ChildProcess
    from tinyserve.engine.engine_procs import EngineProcesses
    from tinyserve.utils import sigint_ignored
    from tinyserve.wire.ipc import bind_address, client_socket_name, make_ipc_dir

    count = args.api_server_count
    try:
        engine_args = engine_args_from(args)
        run_dir = start_tracing(args, engine_args, served_model_name)
    except ValueError as error:
        listener.close()
        print(f"error: {error}", file=sys.stderr)
        return 2
    ipc_dir = make_ipc_dir()
    metrics_dir = _multiproc_dir()
    address = lambda name: bind_address("ipc", ipc_dir, name)
    engines = EngineProcesses(engine_args, ModelInfo.from_args(engine_args), args.data_parallel_size,
                              make_engine_core=build_engine_core)
    servers = []
    try:
        engines.start([[address(client_socket_name(f"input-{e}", i)) for i in range(count)]
                       for e in range(args.data_parallel_size)],
                      [address(client_socket_name("output", i)) for i in range(count)])
        for index in range(count):
            server = ChildProcess(run_api_server, name=f"tinyserve-api-{index}", pass_fds=(listener.fileno(),),
                                  kwargs={"args": args, "listener_fd": listener.fileno(), "engine_args": engine_args,
                                          "run_dir": run_dir, "ipc_dir": ipc_dir, "index": index,
                                          "served_model_name": served_model_name, "serve_api": serve_api})
            with sigint_ignored():
                server.start()
            servers.append(server)
        listener.close()  # the API processes hold it now
        return _supervise(servers, engines, args)
    finally:
        for server in servers:
            server.kill()
        engines.stop()
        shutil.rmtree(ipc_dir, ignore_errors=True)
        if metrics_dir is not None:
            shutil.rmtree(metrics_dir, ignore_errors=True)


def _multiproc_dir() -> str | None:
    """PROMETHEUS_MULTIPROC_DIR for the API processes: the one given, else a new one (returned, to remove)."""
    if os.environ.get(MULTIPROC_DIR_ENV):
        return None
    os.environ[MULTIPROC_DIR_ENV] = tempfile.mkdtemp(prefix="tinyserve-metrics-")
    return os.environ[MULTIPROC_DIR_ENV]


def _supervise(servers: list, engines, args: argparse.Namespace) -> int:
    """Wait until every API process has exited; the server's exit status (1 if one went on its own)."""
    stopping: list[str] = []  # why the API processes were told to stop, once they were
    failed = False

    def stop(why: str) -> None:
        if not stopping:
            stopping.append(why)
            logger.info("stopping the API processes: %s", why)
            for server in servers:
                server.terminate()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: stop(signal.Signals(signum).name))
    deadline = None
    while any(server.exitcode is None for server in servers):
        for index, server in enumerate(servers):
            if server.exitcode is not None and not stopping:
                failed = True
                stop(f"API process {index} (pid {server.pid}) exited with status {server.exitcode}")
        for index, engine in enumerate(engines.processes):
            if engine.exitcode is not None and not stopping and not args.keep_alive_on_engine_death:
                failed = True
                stop(f"engine {index} exited ({engines.exit_reason(index)})")
        if stopping and deadline is None:
            deadline = time.monotonic() + args.shutdown_timeout + _STOP_GRACE_S
        if deadline is not None and time.monotonic() > deadline:
            logger.error("API processes still running %.0f s after the stop: killed",
                         args.shutdown_timeout + _STOP_GRACE_S)
            break
        sentinels = [p.sentinel for p in [*servers, *engines.processes] if p.exitcode is None]
        select.select(sentinels, [], [], _POLL_S)
    statuses = [server.exitcode for server in servers]
    return 1 if failed or any(status != 0 for status in statuses) else 0


def run_api_server(args: argparse.Namespace, listener_fd: int, engine_args, run_dir, ipc_dir: str, index: int,
                   served_model_name: str, serve_api) -> None:
    """API process `index`: an APIServerClient of the engines, and serve_api's HTTP server on the shared listener."""
    import setproctitle

    from tinyserve.config import ModelInfo
    from tinyserve.frontend.api_server_client import APIServerClient
    from tinyserve.lifecycle import schema
    from tinyserve.lifecycle.tracing import keep_images_in, setup_tracing

    setproctitle.setproctitle(f"tinyserve-api-{index}")
    threading.Thread(target=_stop_with_parent, args=(os.getppid(),), name="parent-watchdog", daemon=True).start()
    logging.basicConfig(level=logging.INFO, format=f"%(levelname)s %(asctime)s api-{index} %(name)s: %(message)s")
    listener = socket.socket(fileno=listener_fd)
    if run_dir is not None or args.otlp_endpoint is not None:
        setup_tracing(schema.api_service_name(index), run_dir / schema.api_trace_file(index) if run_dir else None,
                      args.otlp_endpoint, max_bytes=engine_args.trace_max_bytes,
                      resource={schema.RESOURCE_API_SERVER_INDEX: index})
        keep_images_in(None if args.trace_redact_inputs else run_dir)
    client = APIServerClient(engine_args, ModelInfo.from_args(engine_args), args.data_parallel_size, ipc_dir,
                             index, args.api_server_count)
    client.launch()
    names = args.served_model_name or [served_model_name]
    # The LoRA adapters' table, shared by the API processes: each agrees on every name and its id (lora/registry.py).
    args.lora_registry_file = os.path.join(ipc_dir, "lora-registry.json")
    sys.exit(serve_api(args, listener, names, engine_args, client, run_dir, api_server_index=index))


def _stop_with_parent(parent_pid: int) -> None:
    """An API process whose main process is gone (killed outright) drains and exits, as on SIGTERM:
    nobody else would stop it, and it would hold the port."""
    while os.getppid() == parent_pid:
        time.sleep(_POLL_S)
    logger.error("the server's main process %d is gone: stopping", parent_pid)
    os.kill(os.getpid(), signal.SIGTERM)
