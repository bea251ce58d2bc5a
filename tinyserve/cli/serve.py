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
    try:
        engine_args = engine_args_from(args)
        engine = AsyncLLM(engine_args, data_parallel_size=args.data_parallel_size, log_requests=args.log_requests)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    names = args.served_model_name or [args.model or "tinyserve-default"]
    ctx = ServingContext(engine, names)
    app = build_app(ctx, ServerMetrics(names[0], args.data_parallel_size), api_key=args.api_key)
    print(f"tinyserve: serving {names[0]} ({engine.model_info.path}) on http://{args.host}:{args.port}/v1", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level="info", access_log=args.log_requests)
    return 0
