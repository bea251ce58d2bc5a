"""`tinyserve serve` flags for running behind a load balancer (vLLM's external load balancing).

    tinyserve serve MODEL --data-parallel-size 2 --data-parallel-rank 0 --port 8000
    tinyserve serve MODEL --data-parallel-size 2 --data-parallel-rank 1 --port 8001
    a router in front (nginx: upstream { least_conn; server 127.0.0.1:8000; server 127.0.0.1:8001; })

Each server runs one engine, rank R of the data-parallel group, and says so: its
Prometheus series carry engine="R", its trace file is engine-R.jsonl. Nothing passes
between the servers; the router picks one per request, and can ask each how loaded
it is: ORCA load reports on whole chat and completion answers (a request with
endpoint-load-metrics-format: text or json), and GET /load with --enable-server-load-tracking (entrypoints/api/load_reports.py).
"""

import argparse


def add_load_balancing_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("external load balancing")
    group.add_argument("--data-parallel-rank", type=int, default=None, metavar="R",
                       help="serve data-parallel rank R of --data-parallel-size alone, as one engine whose metrics "
                            "and traces say engine R, for a load balancer in front of the ranks' servers "
                            "(vLLM's external load balancing; needs --data-parallel-size of at least 2)")
    group.add_argument("--enable-server-load-tracking", action="store_true",
                       help="count the generation requests in flight, for GET /load ({\"server_load\": N}; "
                            "0 without this flag)")


def check_load_balancing_flags(args: argparse.Namespace) -> str | None:
    """What is wrong with these flags, said with their names, or None."""
    rank, size = args.data_parallel_rank, args.data_parallel_size
    if rank is None:
        return None
    if size < 2:  # vLLM too: external load balancing applies only when data_parallel_size > 1
        return (f"--data-parallel-rank needs --data-parallel-size of at least 2 (it names one engine of several, "
                f"for a load balancer in front), got --data-parallel-size {size}")
    if not 0 <= rank < size:
        return f"--data-parallel-rank must be in [0, {size}) for --data-parallel-size {size}, got {rank}"
    if args.headless:
        return "--data-parallel-rank is for a server of its own; a --headless node takes --data-parallel-start-rank"
    if args.data_parallel_size_local not in (None, 1):  # vLLM's rule as well
        return ("--data-parallel-rank runs one engine: --data-parallel-size-local must be 1 or unset, "
                f"got {args.data_parallel_size_local}")
    return None
