"""`tinyserve serve [MODEL]`: start the OpenAI/Anthropic-compatible server.

It binds 127.0.0.1 unless told otherwise. Overload is answered, not queued
without end: past --max-waiting-requests waiting, new requests get 503 with
Retry-After. SIGTERM (or Ctrl-C) drains: no new requests, the ones in flight
get --shutdown-timeout seconds, the rest end with finish_reason "abort", every
trace file is flushed and nothing of the server is left running. An engine
process that dies fails the requests it held and stops the server the same
way, with exit status 1 (--keep-alive-on-engine-death keeps it up).

With --headless it runs engines for a head node instead (engine/headless.py). With
--api-server-count N, N API processes serve the port (cli/api_servers.py).
"""

import argparse
import logging
import signal
import sys

from tinyserve.cli.api_servers import add_api_server_flags, check_api_server_flags, run_api_servers
from tinyserve.cli.data_parallel_flags import (
    add_data_parallel_flags,
    check_data_parallel_flags,
    node_secret,
    size_local,
)
from tinyserve.cli.engine_flags import add_engine_flags, engine_args_from
from tinyserve.cli.lora_flags import add_lora_modules_flag, lora_registry_from
from tinyserve.cli.load_balancing_flags import add_load_balancing_flags, check_load_balancing_flags
from tinyserve.cli.listener import add_connection_limit_flags, bind_listener
from tinyserve.cli.metrics_flags import add_metrics_flags
from tinyserve.cli.ray_flags import check_ray_flags, join_ray_cluster, ray_engine_client
from tinyserve.cli.start_up_sigterm import exit_if_sigterm_received, exit_on_sigterm
from tinyserve.cli.trace_setup import local_ranks, start_tracing
from tinyserve.cli.vllm_flags import add_vllm_flags, check_vllm_flags
from tinyserve.entrypoints.api.guards.field_limits import (
    DEFAULT_MAX_LOGIT_BIAS_ENTRIES,
    DEFAULT_MAX_MESSAGES,
    DEFAULT_MAX_STOP_STRING_CHARS,
    DEFAULT_MAX_STOP_STRINGS,
    FieldLimits,
)
from tinyserve.entrypoints.api.tools.tool_calls import TOOL_CALL_PARSERS

# Room for a few seconds of arrivals at a busy server's rate, a few MiB of prompts at most.
DEFAULT_MAX_WAITING_REQUESTS = 1024
DEFAULT_SHUTDOWN_TIMEOUT_S = 30.0


def add_parser(commands) -> None:
    parser = commands.add_parser("serve", help="start the HTTP server", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_flags(parser)
    add_data_parallel_flags(parser)
    group = parser.add_argument_group("server")
    group.add_argument("--host", default="127.0.0.1",
                       help="address to bind (default 127.0.0.1; 0.0.0.0 exposes the server to the network)")
    group.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000; 0: any free port)")
    group.add_argument("--served-model-name", nargs="+", default=None,
                       help="name(s) clients use for the model (default: the model argument, or 'tinyserve-default')")
    group.add_argument("--api-key", default=None, help="require this key (Bearer, or x-api-key on /v1/messages) on /v1 routes")
    group.add_argument("--keep-alive-on-engine-death", action="store_true",
                       help="when an engine process dies, keep the server up answering 503 (vLLM's "
                            "VLLM_KEEP_ALIVE_ON_ENGINE_DEATH) instead of exiting with status 1")
    group.add_argument("--log-requests", action="store_true",
                       help="log each request's inputs and one access line per request "
                            "(the log holds prompt text and token ids, --trace-redact-inputs or not)")
    add_api_server_flags(group)
    add_load_balancing_flags(parser)
    add_metrics_flags(parser)
    tools = parser.add_argument_group("tool calling")
    tools.add_argument("--enable-auto-tool-choice", action="store_true",
                       help='let requests use tool_choice "auto" (the default with tools): the model decides, '
                            "and --tool-call-parser reads its calls from the text")
    tools.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS, default=None,
                       help="how the model writes tool calls: hermes = <tool_call>{json}</tool_call> "
                            "(Qwen2.5, Qwen3, Hermes); llama3_json = a reply of JSON calls, "
                            '{"name": ..., "parameters": ...}; ... (Llama 3.1, 3.2)')
    limits = parser.add_argument_group("limits and shutdown")
    limits.add_argument("--max-waiting-requests", type=int, default=DEFAULT_MAX_WAITING_REQUESTS,
                        help="requests (each of n counts) that may wait for a seat in the engines; "
                             "beyond it new ones get 503 with Retry-After (default %(default)s)")
    limits.add_argument("--max-stop-strings", type=int, default=DEFAULT_MAX_STOP_STRINGS,
                        help="most stop strings (stop, stop_sequences) one request may give (default %(default)s; "
                             "OpenAI allows 4)")
    limits.add_argument("--max-stop-string-chars", type=int, default=DEFAULT_MAX_STOP_STRING_CHARS,
                        help="most characters of stop strings one request may give, all together "
                             "(default %(default)s)")
    limits.add_argument("--max-messages", type=int, default=DEFAULT_MAX_MESSAGES,
                        help="most messages one chat may have (default %(default)s); a generation request "
                             "is also refused with more messages than --max-model-len")
    limits.add_argument("--max-logit-bias-entries", type=int, default=DEFAULT_MAX_LOGIT_BIAS_ENTRIES,
                        help="most token ids one request's logit_bias may set (default %(default)s)")
    add_connection_limit_flags(limits)
    limits.add_argument("--shutdown-timeout", type=float, default=DEFAULT_SHUTDOWN_TIMEOUT_S,
                        help="on SIGTERM, seconds in-flight requests get to finish before they are aborted "
                             "(default %(default)s)")
    tracing = parser.add_argument_group("tracing (traces hold prompts and outputs unless --trace-redact-inputs)")
    tracing.add_argument("--trace", action="store_true",
                         help="write OpenTelemetry spans of every stage to a run folder under --trace-dir")
    tracing.add_argument("--trace-dir", default="traces", help="where --trace writes run folders (default traces)")
    tracing.add_argument("--trace-max-mb", type=float, default=None,
                         help="cap the run folder at about this many MB: past it the oldest engine steps "
                              "are dropped first, then new request spans, each counted in manifest.json "
                              "(default: no cap)")
    tracing.add_argument("--otlp-endpoint", "--otlp-traces-endpoint", dest="otlp_endpoint", default=None,
                         help="also export spans over OTLP/HTTP, e.g. http://localhost:4318 (Jaeger, Tempo, a collector); "
                              "--otlp-traces-endpoint is vLLM's name for it")
    tracing.add_argument("--trace-redact-inputs", action="store_true",
                         help="keep token counts in traces but drop prompt and output text and token ids "
                              "(replay then needs the prompts from elsewhere)")
    add_lora_modules_flag(parser)
    add_vllm_flags(parser)
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    signal.signal(signal.SIGTERM, exit_on_sigterm)  # until the server's own handler (guards/shutdown.py) takes over
    problem = (_check_server_flags(args) or check_load_balancing_flags(args) or check_vllm_flags(args)
               or check_ray_flags(args) or check_api_server_flags(args))
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    names = args.served_model_name or [args.model or "tinyserve-default"]
    if args.headless:
        return run_headless(args, names[0])
    try:
        listener = bind_listener(args.host, args.port)
    except OSError as error:
        print(f"error: cannot listen on {args.host}:{args.port}: {error.strerror or error}", file=sys.stderr)
        return 2
    if args.api_server_count > 1:
        return run_api_servers(args, listener, names[0], serve_api)
    client = None
    try:
        engine_args = engine_args_from(args)
        run_dir = start_tracing(args, engine_args, names[0])
        client = launch_engines(args, engine_args)
    except ValueError as error:
        listener.close()
        print(f"error: {error}", file=sys.stderr)
        return 2
    return serve_api(args, listener, names, engine_args, client, run_dir)


def serve_api(args: argparse.Namespace, listener, names: list[str], engine_args, client, run_dir,
              api_server_index: int | None = None) -> int:
    """Serve HTTP on `listener` with this engine client until SIGTERM (or an engine's death); the exit status.

    api_server_index: this process's index among --api-server-count API processes (None: the only one).
    """
    try:
        # The rest of the API process (its modules, the tokenizer, the app) is set up while the engines load.
        from tinyserve.assemble import ANSWER_LAYERS
        from tinyserve.entrypoints.api.answer_layers import build_answer_layers
        from tinyserve.frontend.async_llm import AsyncLLM
        from tinyserve.lifecycle.tracing import tracing_enabled

        # Traced (--trace, --otlp-endpoint: start_tracing, or run_api_server's): every request must replay.
        engine = AsyncLLM(engine_args, data_parallel_size=args.data_parallel_size, log_requests=args.log_requests,
                          max_waiting_requests=args.max_waiting_requests, multi_node=client.multi_node,
                          data_parallel_rank=args.data_parallel_rank, client=client, seed_unseeded=tracing_enabled())
        loras = lora_registry_from(args, engine_args, engine.model_info.path, names[0])
        if args.chat_template is not None:  # vLLM's --chat-template: chats are rendered with it (vllm_flags.py)
            engine.tokenizer.chat_template = args.chat_template
        answer_layers = build_answer_layers(ANSWER_LAYERS, args, engine.tokenizer)  # --reasoning-parser's
    except ValueError as error:
        client.shutdown()
        listener.close()
        print(f"error: {error}", file=sys.stderr)
        return 2
    from tinyserve.entrypoints.api.metrics import ServerMetrics
    from tinyserve.entrypoints.api.serving_engine import ServingContext
    from tinyserve.entrypoints.api.server import build_app
    from tinyserve.entrypoints.api.guards.shutdown import GracefulServer
    from tinyserve.entrypoints.api.guards.slow_clients import DeadlineProtocol
    import uvicorn

    ctx = ServingContext(engine, names, redact_inputs=args.trace_redact_inputs,
                         tool_call_parser=args.tool_call_parser if args.enable_auto_tool_choice else None,
                         return_tokens_as_token_ids=args.return_tokens_as_token_ids, loras=loras,
                         per_request_metrics=args.enable_per_request_metrics, answer_layers=answer_layers)
    if run_dir is not None:
        print(f"tinyserve: tracing to {run_dir}", flush=True)
    field_limits = FieldLimits(max_stop_strings=args.max_stop_strings, max_stop_string_chars=args.max_stop_string_chars,
                               max_messages=args.max_messages, max_logit_bias_entries=args.max_logit_bias_entries)
    metrics = ServerMetrics(names[0], engine.engine_indices, engine.model_info.max_model_len,
                            prefix=args.metrics_prefix, api_server_index=api_server_index)
    app = build_app(ctx, metrics, api_key=args.api_key, max_request_body_bytes=args.max_request_body_bytes,
                    field_limits=field_limits, track_server_load=args.enable_server_load_tracking)
    port = listener.getsockname()[1]
    print(f"tinyserve: serving {names[0]} ({engine.model_info.path}) on http://{args.host}:{port}/v1", flush=True)
    config = uvicorn.Config(app, host=args.host, port=port, log_level="info", access_log=args.log_requests,
                            http=DeadlineProtocol.with_timeouts(args.http_header_timeout, args.http_body_timeout),
                            timeout_keep_alive=args.timeout_keep_alive)
    exit_if_sigterm_received()  # a SIGTERM during start-up that something swallowed
    server = GracefulServer(config, engine, args.shutdown_timeout,
                            keep_alive_on_engine_death=args.keep_alive_on_engine_death)
    # Returns after a graceful shutdown; uvicorn then re-raises the signal that asked for it.
    server.run(sockets=[listener])
    return server.exit_code


def launch_engines(args: argparse.Namespace, engine_args):
    """The server's engine client, its local engines spawned already (MPClient.launch): they import
    torch and load the model while this process imports the rest of itself and loads the tokenizer."""
    from tinyserve.config import ModelInfo
    from tinyserve.frontend.core_client import MPClient

    model_info = ModelInfo.from_args(engine_args)
    join_ray_cluster(args, engine_args)  # under a ray backend: the cluster every engine then joins (ray_flags.py)
    client = ray_engine_client(args, engine_args, model_info) if args.data_parallel_backend == "ray" else \
        MPClient.for_engines(engine_args, model_info, args.data_parallel_size, args.data_parallel_rank,
                             _multi_node(args))
    client.launch()
    return client


def _multi_node(args: argparse.Namespace):
    from tinyserve.frontend.remote_engines import MultiNode

    if args.data_parallel_rank is not None or size_local(args) == args.data_parallel_size:
        return None
    return MultiNode(size_local(args), args.data_parallel_address, args.data_parallel_rpc_port,
                     node_secret=node_secret(args))


def run_headless(args: argparse.Namespace, served_model_name: str) -> int:
    """Engines only, for the head at --data-parallel-address; returns when the head stops or is lost."""
    from tinyserve.assemble import build_engine_core
    from tinyserve.engine.headless import HeadlessNode

    try:
        engine_args = engine_args_from(args)
        run_dir = start_tracing(args, engine_args, served_model_name, node_ranks=local_ranks(args))
        node = HeadlessNode(engine_args, args.data_parallel_size, size_local(args), args.data_parallel_start_rank,
                            args.data_parallel_address, args.data_parallel_rpc_port, node_secret=node_secret(args),
                            make_engine_core=build_engine_core)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if run_dir is not None:
        print(f"tinyserve: tracing to {run_dir}", flush=True)
    print(f"tinyserve: headless, ranks {node.ranks[0]}-{node.ranks[-1]} for the head at {node.head}", flush=True)
    try:
        return node.run()
    finally:
        from tinyserve.lifecycle.tracing import shutdown_tracing

        shutdown_tracing()


def _check_server_flags(args: argparse.Namespace) -> str | None:
    if not 0 <= args.port <= 65535:
        return f"--port must be in [0, 65535], got {args.port}"
    problem = check_data_parallel_flags(args)
    if problem is not None:
        return problem
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        return "--enable-auto-tool-choice needs --tool-call-parser"
    if args.max_waiting_requests < 1:
        return f"--max-waiting-requests must be at least 1, got {args.max_waiting_requests}"
    if args.max_request_body_bytes < 1:
        return f"--max-request-body-bytes must be at least 1, got {args.max_request_body_bytes}"
    for flag in ("max_stop_strings", "max_stop_string_chars", "max_messages", "max_logit_bias_entries"):
        if getattr(args, flag) < 1:
            return f"--{flag.replace('_', '-')} must be at least 1, got {getattr(args, flag)}"
    for flag in ("http_header_timeout", "http_body_timeout", "timeout_keep_alive"):
        if not getattr(args, flag) > 0:
            return f"--{flag.replace('_', '-')} must be positive, got {getattr(args, flag)}"
    if args.shutdown_timeout < 0:
        return f"--shutdown-timeout must be non-negative, got {args.shutdown_timeout}"
    if args.trace_max_mb is not None and not args.trace_max_mb > 0:
        return f"--trace-max-mb must be positive, got {args.trace_max_mb}"
    return None
