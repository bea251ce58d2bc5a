"""`tinyserve serve --trace`: the run folder's manifest, and this process's tracer."""

import argparse

from tinyserve.cli.data_parallel_flags import size_local


def local_ranks(args: argparse.Namespace) -> list[int]:
    if args.data_parallel_rank is not None:
        return [args.data_parallel_rank]
    start = args.data_parallel_start_rank or 0
    return list(range(start, start + size_local(args)))


def start_tracing(args: argparse.Namespace, engine_args, served_model_name: str, node_ranks: list[int] | None = None):
    """Set up this process's tracer and tell the engines where to write; returns the run folder.

    node_ranks: on a headless node, the ranks it serves (its manifest says so, for `trace merge`).
    """
    from dataclasses import asdict

    from tinyserve.config import ModelInfo
    from tinyserve.lifecycle import schema
    from tinyserve.lifecycle.tracing import (host_name, keep_images_in, new_run_dir, setup_tracing, trace_cap_bytes,
                                            write_manifest)
    from tinyserve.models.fingerprint import manifest_fingerprint

    if not args.trace and args.otlp_endpoint is None:
        return None
    run_dir = new_run_dir(args.trace_dir) if args.trace else None
    cap = trace_cap_bytes(args.trace_max_mb)  # of the whole folder: every process checks it
    if run_dir is not None:
        engine_args.trace_max_bytes = cap
        write_manifest(run_dir, model=args.model, served_model_name=served_model_name,
                       engine_args=asdict(engine_args), data_parallel_size=args.data_parallel_size,
                       model_fingerprint=manifest_fingerprint(ModelInfo.from_args(engine_args).path),
                       trace_max_mb=args.trace_max_mb,
                       node={"host": host_name(), "headless": node_ranks is not None,
                             "ranks": node_ranks if node_ranks is not None else local_ranks(args),
                             "api_server_count": 0 if node_ranks is not None else args.api_server_count})
        engine_args.trace_run_dir = str(run_dir)
    engine_args.otlp_endpoint = args.otlp_endpoint
    if node_ranks is not None or args.api_server_count > 1:
        return run_dir  # a headless node has no API process; several API processes each start their own
    setup_tracing(schema.SERVICE_API, run_dir / schema.API_TRACE_FILE if run_dir else None, args.otlp_endpoint,
                  max_bytes=cap)
    keep_images_in(None if args.trace_redact_inputs else run_dir)
    return run_dir
