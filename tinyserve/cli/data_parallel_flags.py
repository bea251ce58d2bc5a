"""`tinyserve serve`'s data-parallel flags, with vLLM's names and defaults.

One machine:     --data-parallel-size 2                      two engines, one API server
Several nodes:   the head   --data-parallel-size 4 --data-parallel-size-local 2
                            --data-parallel-address HEAD_IP [--data-parallel-rpc-port 29550]
                 each other --headless, the same four flags, and --data-parallel-start-rank 2
The head serves the API and ranks 0 .. size_local-1; a headless node serves ranks
start_rank .. start_rank+size_local-1 and no API (engine/headless.py, wire/nodes.py).
A node secret (--data-parallel-node-secret, or TINYSERVE_DP_NODE_SECRET) set on all of
them keeps other hosts from joining (frontend/remote_engines.py).
"""

import argparse
import os

from tinyserve.cli.ray_flags import add_data_parallel_backend_flag

DEFAULT_ADDRESS = "127.0.0.1"  # vLLM's data_parallel_master_ip default
DEFAULT_RPC_PORT = 29550  # vLLM's data_parallel_rpc_port default


def add_data_parallel_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("data parallel (several engines, on one node or several)")
    group.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                       help="number of engines in all, each with its own scheduler and KV cache (default 1)")
    group.add_argument("--data-parallel-size-local", "-dpl", type=int, default=None,
                       help="how many of them run on this node (default: all); the head waits for "
                            "headless nodes to bring the rest")
    group.add_argument("--data-parallel-address", "-dpa", default=DEFAULT_ADDRESS,
                       help="the head node's address, as the other nodes reach it: the head listens "
                            "there, headless nodes connect to it (default %(default)s)")
    group.add_argument("--data-parallel-rpc-port", "-dpp", type=int, default=DEFAULT_RPC_PORT,
                       help="the head's port for headless nodes to join and send heartbeats (default %(default)s)")
    group.add_argument("--data-parallel-start-rank", "-dpr", type=int, default=None,
                       help="with --headless: the first rank this node serves")
    group.add_argument("--headless", action="store_true",
                       help="run engines only, for the head at --data-parallel-address: no API server")
    add_node_secret_flag(group)
    add_data_parallel_backend_flag(group)  # mp or ray (cli/ray_flags.py)


# ---- the node secret ---------------------------------------------------------------------
# The flag is named like the others; the variable like vLLM's VLLM_DP_* ones, with this
# project's prefix. The variable is the one to use: a flag's value shows in `ps`.
NODE_SECRET_ENV = "TINYSERVE_DP_NODE_SECRET"


def add_node_secret_flag(group) -> None:
    group.add_argument("--data-parallel-node-secret", default=None, metavar="SECRET",
                       help=f"a secret shared by the head and its headless nodes: the head refuses a node "
                            f"without it (default: ${NODE_SECRET_ENV}, which stays out of `ps`; without "
                            f"either, any host that reaches --data-parallel-rpc-port can join)")


def node_secret(args: argparse.Namespace) -> str | None:
    """--data-parallel-node-secret, else $TINYSERVE_DP_NODE_SECRET, else None."""
    return args.data_parallel_node_secret or os.environ.get(NODE_SECRET_ENV) or None


def check_node_secret(args: argparse.Namespace) -> str | None:
    from tinyserve.wire.nodes import MAX_NODE_SECRET_CHARS

    secret = node_secret(args)
    if secret is not None and len(secret) > MAX_NODE_SECRET_CHARS:
        return f"--data-parallel-node-secret (or {NODE_SECRET_ENV}) may be {MAX_NODE_SECRET_CHARS} characters at most"
    return None


def size_local(args: argparse.Namespace) -> int:
    return args.data_parallel_size if args.data_parallel_size_local is None else args.data_parallel_size_local


def check_data_parallel_flags(args: argparse.Namespace) -> str | None:
    """The first problem with the data-parallel flags, as a message naming them; None if they fit."""
    size = args.data_parallel_size
    if size < 1:
        return f"--data-parallel-size must be at least 1, got {size}"
    local = size_local(args)
    if not 1 <= local <= size:
        return f"--data-parallel-size-local must be in [1, --data-parallel-size={size}], got {local}"
    if not 1 <= args.data_parallel_rpc_port <= 65535:
        return f"--data-parallel-rpc-port must be in [1, 65535], got {args.data_parallel_rpc_port}"
    start = args.data_parallel_start_rank
    if args.headless:
        if start is None:
            return "--headless needs --data-parallel-start-rank (the first rank this node serves)"
        if start < 1 or start + local > size:
            return (f"--data-parallel-start-rank {start} with --data-parallel-size-local {local} must fit in "
                    f"ranks [1, {size}) (rank 0 is the head's); got ranks {start}-{start + local - 1}")
    elif start not in (None, 0):
        return f"--data-parallel-start-rank {start} is for --headless nodes; the head always starts at rank 0"
    return check_node_secret(args)
