"""`tinyserve serve [MODEL]`: start the OpenAI/Anthropic-compatible server."""

import argparse
import logging
import sys

import uvicorn

from tinyserve.cli.engine_flags import add_engine_flags, engine_args_from


def add_parser(commands) -> None:
    parser = commands.add_parser("serve", help="start the HTTP server", description=__doc__,
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_engine_flags(parser)
    group = parser.add_argument_group("server")
    group.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 exposes the server to the network)")
    group.add_argument("--port", type=int, default=8000, help="port to listen on")
    group.add_argument("--served-model-name", nargs="+", default=None,
                       help="name(s) clients use for the model (default: the model argument, or 'tinyserve-default')")
    group.add_argument("--api-key", default=None, help="require this key (Bearer, or x-api-key on /v1/messages) on /v1 routes")
    group.add_argument("--data-parallel-size", type=int, default=1, help="number of engine processes, each with its own KV cache")
    group.add_argument("--log-requests", action="store_true", help="log each request's inputs and one access line per request")
    tracing = parser.add_argument_group("tracing (traces and request logs contain prompts and outputs)")
    tracing.add_argument("--trace", action="store_true",
                         help="write OpenTelemetry spans of every stage to a run folder under --trace-dir")
    tracing.add_argument("--trace-dir", default="traces", help="where --trace writes run folders")
    tracing.add_argument("--otlp-endpoint", default=None,
                         help="also export spans over OTLP/HTTP, e.g. http://localhost:4318 (Jaeger, Tempo, a collector)")
    tracing.add_argument("--trace-redact-inputs", action="store_true",
                         help="keep token counts in traces but drop prompt and output text and token ids")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from tinyserve.engine.async_llm import AsyncLLM
    from tinyserve.entrypoints.api.metrics import ServerMetrics
    from tinyserve.entrypoints.api.openai_serving import ServingContext
    from tinyserve.entrypoints.api.server import build_app

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    if args.data_parallel_size < 1:
        print("error: --data-parallel-size must be at least 1", file=sys.stderr)
        return 2
    names = args.served_model_name or [args.model or "tinyserve-default"]
    try:
        engine_args = engine_args_from(args)
        run_dir = start_tracing(args, engine_args, names[0])
        engine = AsyncLLM(engine_args, data_parallel_size=args.data_parallel_size, log_requests=args.log_requests)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    ctx = ServingContext(engine, names, redact_inputs=args.trace_redact_inputs)
    if run_dir is not None:
        print(f"tinyserve: tracing to {run_dir}", flush=True)
    app = build_app(ctx, ServerMetrics(names[0], args.data_parallel_size), api_key=args.api_key)
    print(f"tinyserve: serving {names[0]} ({engine.model_info.path}) on http://{args.host}:{args.port}/v1", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level="info", access_log=args.log_requests)
    return 0


def start_tracing(args: argparse.Namespace, engine_args, served_model_name: str):
    """Set up this process's tracer and tell the engines where to write; returns the run folder."""
    from dataclasses import asdict

    from tinyserve.lifecycle import schema
    from tinyserve.lifecycle.tracing import new_run_dir, setup_tracing, write_manifest

    if not args.trace and args.otlp_endpoint is None:
        return None
    run_dir = new_run_dir(args.trace_dir) if args.trace else None
    if run_dir is not None:
        write_manifest(run_dir, model=args.model, served_model_name=served_model_name,
                       engine_args=asdict(engine_args), data_parallel_size=args.data_parallel_size)
        engine_args.trace_run_dir = str(run_dir)
    engine_args.otlp_endpoint = args.otlp_endpoint
    setup_tracing(schema.SERVICE_API, run_dir / schema.API_TRACE_FILE if run_dir else None, args.otlp_endpoint)
    return run_dir
