"""`tinyserve router --backend URL [URL ...]`: one OpenAI endpoint in front of several servers.

    tinyserve serve MODEL --data-parallel-size 2 --data-parallel-rank 0 --port 8001 --kv-events-config '{...}'
    tinyserve serve MODEL --data-parallel-size 2 --data-parallel-rank 1 --port 8002 --kv-events-config '{...}'
    tinyserve router --backend http://127.0.0.1:8001 http://127.0.0.1:8002 --policy prefix-aware \\
        --kv-events tcp://127.0.0.1:5557 tcp://127.0.0.1:5558 --tokenizer MODEL --port 8000

Policies: round_robin (each in turn), least_load (the fewest requests waiting there, from the
backends' ORCA reports, plus the router's own in flight), prefix-aware (the backend whose KV
cache already holds the longest prefix of the prompt, from the backends' KV cache events;
ties to the least loaded). With --trace the router writes router.jsonl in a run folder of its
own; `tinyserve trace merge` joins it with the backends' folders into one run.

A backend is passed over once it fails a request (refused, dropped, or no answer within
--backend-header-timeout) or --health-failure-threshold health checks in a row, until a health
check finds it answering; the router's /health is 503 while no backend is up. Clients get the
server's own limits: --max-request-body-bytes, --http-header-timeout, --http-body-timeout.
"""

import argparse
import logging
import sys
from urllib.parse import urlsplit

from tinyserve.cli.listener import add_connection_limit_flags, bind_listener
from tinyserve.router.defaults import (
    DEFAULT_BACKEND_HEADER_TIMEOUT_S,
    DEFAULT_HEALTH_CHECK_INTERVAL_S,
    DEFAULT_HEALTH_CHECK_TIMEOUT_S,
    DEFAULT_HEALTH_FAILURE_THRESHOLD,
    DEFAULT_KV_INDEX_MAX_BLOCKS,
)
from tinyserve.router.policies import POLICIES


def add_parser(commands) -> None:
    parser = commands.add_parser("router", help="route OpenAI requests over several tinyserve servers",
                                 description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000; 0: any free port)")
    parser.add_argument("--backend", nargs="+", default=None, metavar="URL",
                        help="the servers to route to, e.g. http://127.0.0.1:8001 (required)")
    parser.add_argument("--policy", choices=POLICIES, default="round_robin",
                        help="how a backend is chosen (default %(default)s)")
    pd = parser.add_argument_group("prefill/decode disaggregation (router/pd.py), in place of --backend")
    pd.add_argument("--prefill", nargs="+", default=None, metavar="URL",
                    help="servers started with --kv-transfer-config kv_role kv_producer: each request's prompt is "
                         "computed there (max_tokens=1)")
    pd.add_argument("--decode", nargs="+", default=None, metavar="URL",
                    help="servers started with kv_role kv_consumer: each request continues there from the "
                         "prefill's K/V, and its answer is the client's")
    prefix = parser.add_argument_group("prefix-aware")
    prefix.add_argument("--kv-events", nargs="+", default=None, metavar="ENDPOINT",
                        help="each backend's KV cache events endpoint (ZeroMQ, e.g. tcp://127.0.0.1:5557), "
                             "one per --backend, in the same order")
    prefix.add_argument("--tokenizer", default=None, metavar="MODEL",
                        help="the backends' model (folder or name), whose tokenizer and chat template turn a "
                             "request into the tokens the backends will cache (default: the built-in model, "
                             "which `tinyserve serve` serves without one)")
    prefix.add_argument("--block-size", type=int, default=None,
                        help="the backends' KV block size, in tokens (default: what the backends report on /metrics, "
                             "vLLM's cache_config_info; 16, the engine's default, if none does)")
    prefix.add_argument("--kv-index-max-blocks", type=int, default=DEFAULT_KV_INDEX_MAX_BLOCKS,
                        help="most block hashes the router keeps per backend from its KV events; past it the "
                             "oldest stored are dropped (default %(default)s)")
    add_health_flags(parser)
    add_limit_flags(parser)
    tracing = parser.add_argument_group("tracing")
    tracing.add_argument("--trace", action="store_true",
                         help="write the router's spans to router.jsonl in a run folder under --trace-dir")
    tracing.add_argument("--trace-dir", default="traces", help="where --trace writes run folders (default traces)")
    tracing.add_argument("--otlp-endpoint", "--otlp-traces-endpoint", dest="otlp_endpoint", default=None,
                         help="also export spans over OTLP/HTTP")
    parser.set_defaults(handler=run)


def add_health_flags(parser) -> None:
    health = parser.add_argument_group("backend health (vLLM's router's names)")
    health.add_argument("--health-check-interval-secs", type=float, default=DEFAULT_HEALTH_CHECK_INTERVAL_S,
                        help="seconds between two checks of every backend's GET /health (default %(default)s)")
    health.add_argument("--health-check-timeout-secs", type=float, default=DEFAULT_HEALTH_CHECK_TIMEOUT_S,
                        help="seconds a backend's /health may take to answer; then the check failed "
                             "(default %(default)s)")
    health.add_argument("--health-failure-threshold", type=int, default=DEFAULT_HEALTH_FAILURE_THRESHOLD,
                        help="failed checks in a row that take a backend out until a check succeeds "
                             "(default %(default)s); a failed request takes it out at once")
    health.add_argument("--backend-header-timeout", type=float, default=DEFAULT_BACKEND_HEADER_TIMEOUT_S,
                        help="seconds a backend may take to send an answer's status line and headers (a whole, "
                             "not streamed, answer sends them once generated); then the client gets 504 and the "
                             "backend is taken out (default %(default)s)")


def add_limit_flags(parser) -> None:
    limits = parser.add_argument_group("client limits (the server's own)")
    add_connection_limit_flags(limits)


def check_router_flags(args: argparse.Namespace) -> str | None:
    """The first problem with the flags, naming them; None if they fit."""
    problem = check_limit_flags(args)
    if problem is not None:
        return problem
    if args.prefill or args.decode:
        return check_pd_flags(args)
    if not args.backend:
        return "--backend needs at least one URL (e.g. --backend http://127.0.0.1:8001)"
    for url in args.backend:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            return f"--backend {url!r} is not an http(s) URL with a host (e.g. http://127.0.0.1:8001)"
    if len(set(args.backend)) != len(args.backend):
        return "--backend lists the same URL twice"
    if args.block_size is not None and args.block_size < 1:
        return f"--block-size must be at least 1, got {args.block_size}"
    if args.policy == "prefix-aware" and not args.kv_events:
        return "--policy prefix-aware needs --kv-events, one endpoint per --backend"
    if args.kv_events and len(args.kv_events) != len(args.backend):
        return (f"--kv-events needs one endpoint per --backend, in the same order: got {len(args.kv_events)} "
                f"for {len(args.backend)} backends")
    if args.kv_events and args.policy != "prefix-aware":
        return f"--kv-events is read by --policy prefix-aware only (the policy is {args.policy})"
    return None


def check_limit_flags(args: argparse.Namespace) -> str | None:
    """The port, the health checks and the client limits, in either mode."""
    if not 0 <= args.port <= 65535:
        return f"--port must be in [0, 65535], got {args.port}"
    for flag in ("health_check_interval_secs", "health_check_timeout_secs", "backend_header_timeout",
                 "http_header_timeout", "http_body_timeout", "timeout_keep_alive"):
        if not getattr(args, flag) > 0:  # NaN too
            return f"--{flag.replace('_', '-')} must be positive, got {getattr(args, flag)}"
    for flag in ("health_failure_threshold", "max_request_body_bytes", "kv_index_max_blocks"):
        if getattr(args, flag) < 1:
            return f"--{flag.replace('_', '-')} must be at least 1, got {getattr(args, flag)}"
    return None


def check_pd_flags(args: argparse.Namespace) -> str | None:
    """--prefill and --decode: both, URLs, and none of the flags of the other mode."""
    if not args.prefill or not args.decode:
        return "prefill/decode mode needs both --prefill URL ... and --decode URL ..."
    if args.backend or args.kv_events:
        return "--prefill/--decode take the place of --backend (and --kv-events): give one or the other"
    for url in [*args.prefill, *args.decode]:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            return f"{url!r} is not an http(s) URL with a host (e.g. http://127.0.0.1:8001)"
    if len(set(args.prefill + args.decode)) != len(args.prefill) + len(args.decode):
        return "--prefill and --decode list the same URL twice"
    return None


def build_router(args: argparse.Namespace):
    """The Router the app serves. Another dispatch mode (prefill/decode, router/pd.py) is built here
    from its own flags, and serves the same app."""
    from tinyserve.router.app import Router
    from tinyserve.router.backends import Backend
    from tinyserve.router.health import HealthChecks

    settings = dict(health=HealthChecks(args.health_check_interval_secs, args.health_check_timeout_secs,
                                        args.health_failure_threshold),
                    header_timeout_s=args.backend_header_timeout)
    if args.prefill:
        from tinyserve.router.pd import PDRouter

        urls = [url.rstrip("/") for url in args.prefill + args.decode]
        backends = [Backend(url, index) for index, url in enumerate(urls)]
        return PDRouter(backends[: len(args.prefill)], backends[len(args.prefill):], **settings)
    backends = [Backend(url.rstrip("/"), index) for index, url in enumerate(args.backend)]
    return Router(backends, make_policy(args, backends), **settings)


def make_policy(args: argparse.Namespace, backends):
    from tinyserve.router.policies import LeastLoad, RoundRobin

    if args.policy == "round_robin":
        return RoundRobin()
    if args.policy == "least_load":
        return LeastLoad()
    from tinyserve.router.prefix_aware import PrefixAware

    return PrefixAware.from_flags(backends, args.kv_events, args.tokenizer, args.block_size,
                                  args.kv_index_max_blocks)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line for every forwarded request otherwise
    problem = check_router_flags(args)
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    try:
        listener = bind_listener(args.host, args.port)
    except OSError as error:
        print(f"error: cannot listen on {args.host}:{args.port}: {error.strerror or error}", file=sys.stderr)
        return 2
    try:
        router = build_router(args)
    except ValueError as error:
        listener.close()
        print(f"error: {error}", file=sys.stderr)
        return 2
    import uvicorn

    from tinyserve.entrypoints.api.guards.slow_clients import DeadlineProtocol
    from tinyserve.router.app import build_app

    run_dir = start_tracing(args)
    if run_dir is not None:
        print(f"tinyserve: tracing to {run_dir}", flush=True)
    port = listener.getsockname()[1]
    mode = f"prefill {' '.join(args.prefill)}, decode {' '.join(args.decode)}" if args.prefill \
        else f"({args.policy}) over {', '.join(args.backend)}"
    print(f"tinyserve: routing {mode} on http://{args.host}:{port}/v1",
          flush=True)
    config = uvicorn.Config(build_app(router, args.max_request_body_bytes), host=args.host, port=port,
                            log_level="info", access_log=False,
                            http=DeadlineProtocol.with_timeouts(args.http_header_timeout, args.http_body_timeout),
                            timeout_keep_alive=args.timeout_keep_alive)
    uvicorn.Server(config).run(sockets=[listener])
    return 0


def start_tracing(args: argparse.Namespace):
    """The router's tracer, and its run folder (a manifest that says it is a router's); None without --trace."""
    from tinyserve.lifecycle import schema
    from tinyserve.lifecycle.tracing import host_name, new_run_dir, setup_tracing, write_manifest

    if not args.trace and args.otlp_endpoint is None:
        return None
    run_dir = new_run_dir(args.trace_dir) if args.trace else None
    if run_dir is not None:
        write_manifest(run_dir, model=args.tokenizer, served_model_name="", engine_args={},
                       data_parallel_size=len(args.backend or args.prefill + args.decode),
                       node={"host": host_name(), "headless": False, "router": True, "ranks": [],
                             "policy": "pd" if args.prefill else args.policy,
                             "backends": args.backend or args.prefill + args.decode})
    setup_tracing(schema.SERVICE_ROUTER, run_dir / schema.ROUTER_TRACE_FILE if run_dir else None, args.otlp_endpoint)
    return run_dir
