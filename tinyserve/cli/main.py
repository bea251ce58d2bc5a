"""`tinyserve <command>`: serve, chat, complete, run-batch (and more as they land)."""

import argparse
import sys

from tinyserve.cli import bench, clients, run_batch, serve, trace


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tinyserve", description="An LLM serving stack to read and watch.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve.add_parser(commands)
    clients.add_parsers(commands)
    run_batch.add_parser(commands)
    bench.add_parser(commands)
    trace.add_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.handler(args) or 0


if __name__ == "__main__":
    sys.exit(main())
