"""`tinyserve <command>`: serve, chat, complete, run-batch (and more as they land)."""

import argparse
import sys

from tinyserve.cli import bench, clients, router, run_batch, serve, trace
from tinyserve.cli.engine_flags import settle_model


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tinyserve", description="An LLM serving stack to read and watch.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve.add_parser(commands)
    clients.add_parsers(commands)
    run_batch.add_parser(commands)
    bench.add_parser(commands)
    trace.add_parser(commands)
    router.add_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    from tinyserve.cli.vllm_flags import vllm_argv  # vLLM's spellings: --max_model_len, --x-config.field VALUE

    args = build_parser().parse_args(vllm_argv(sys.argv[1:] if argv is None else argv))
    if hasattr(args, "model_flag"):  # a command with the engine flags
        problem = settle_model(args)
        if problem is not None:
            print(f"error: {problem}", file=sys.stderr)
            return 2
    try:
        return args.handler(args) or 0
    except KeyboardInterrupt:  # Ctrl-C before a command could take it over (the server drains instead)
        print("interrupted", file=sys.stderr)
        return 130  # a shell's status for SIGINT: 128 + 2


if __name__ == "__main__":
    sys.exit(main())
