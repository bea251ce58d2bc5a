"""The Ray flags, named as vLLM's: where tensor-parallel ranks and data-parallel engines run.

    --distributed-executor-backend ray    engine flag (serve, run-batch, the benchmarks): ranks 1..N-1
                                          of --tensor-parallel-size as Ray actors
    --data-parallel-backend ray           serve: the --data-parallel-size engines as Ray actors
    --ray-resources '{"node_b": 1}'       Ray resources each actor's bundle asks for, to put the
                                          actors on the nodes `ray start --resources` gave them

The cluster is RAY_ADDRESS's, or the one `ray start --head` started on this machine, or a
local one started for the server (tinyserve/distributed/ray_cluster.py).
"""

import argparse
import json

from tinyserve.distributed.ray_cluster import BACKENDS, check_ray, check_resources


def add_ray_engine_flags(group) -> None:
    group.add_argument("--distributed-executor-backend", choices=BACKENDS, default="mp",
                       help="what runs tensor-parallel ranks 1..N-1: mp, processes on this machine; ray, "
                            "Ray actors placed on a Ray cluster (default mp)")
    group.add_argument("--ray-resources", type=resources_json, default=None, metavar="JSON",
                       help='Ray resources each Ray actor\'s bundle asks for besides its CPU or GPU, e.g. '
                            '\'{"node_b": 1}\' to run them on the nodes `ray start --resources` tagged so')


def resources_json(text: str) -> dict:
    """--ray-resources' JSON, checked (argparse reports the error as a usage error)."""
    try:
        resources = json.loads(text)
        check_resources(resources)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return resources


def ray_engine_kwargs(args: argparse.Namespace) -> dict:
    return dict(distributed_executor_backend=args.distributed_executor_backend, ray_resources=args.ray_resources)


def add_data_parallel_backend_flag(group) -> None:
    group.add_argument("--data-parallel-backend", "-dpb", choices=BACKENDS, default="mp",
                       help="what runs the engines: mp, processes of this server (and --headless nodes); "
                            "ray, Ray actors placed on a Ray cluster (default mp)")


def check_ray_flags(args: argparse.Namespace) -> str | None:
    """The problem with the Ray flags of `serve` as a message naming them; None if they fit."""
    if args.data_parallel_backend != "ray":
        if args.ray_resources is not None and args.distributed_executor_backend != "ray":
            return "--ray-resources places Ray actors: it needs --data-parallel-backend ray or " \
                   "--distributed-executor-backend ray"
        return None
    try:
        check_ray("--data-parallel-backend")
    except ValueError as error:
        return str(error)
    for flag, value in (("--headless", args.headless), ("--data-parallel-rank", args.data_parallel_rank),
                        ("--data-parallel-size-local", args.data_parallel_size_local),
                        ("--data-parallel-start-rank", args.data_parallel_start_rank)):
        if value not in (None, False):
            return f"{flag} is for --data-parallel-backend mp: with ray, Ray places every engine"
    return None


def ray_engine_client(args: argparse.Namespace, engine_args, model_info):
    """The server's engine client under --data-parallel-backend ray (frontend/ray_client.py)."""
    from tinyserve.frontend.ray_client import RayMPClient

    return RayMPClient(engine_args, model_info, args.data_parallel_size, args.data_parallel_address)


def join_ray_cluster(args: argparse.Namespace, engine_args) -> None:
    """Under either ray backend, join (or start) the cluster in this process first: its address goes to
    every engine in RAY_ADDRESS, so that engine processes placing ranks join the same cluster."""
    if args.data_parallel_backend == "ray" or engine_args.distributed_executor_backend == "ray":
        from tinyserve.distributed.ray_cluster import connect

        connect(cpus_needed=args.data_parallel_size * engine_args.tensor_parallel_size)
