"""Joining a Ray cluster, and placing actors on it with placement groups.

`connect()` joins the cluster RAY_ADDRESS names, or the one `ray start --head` started on this
machine; with neither, it starts a local cluster of this machine alone (Ray's own `ray.init()`
order), small and quiet: no dashboard, the actors' logs left in Ray's session folder rather
than copied to this process's output. The address of the cluster joined is put in RAY_ADDRESS,
so the engine processes this one starts join the same cluster instead of starting their own.

A placement group reserves one bundle of resources per actor before any starts: `{"CPU": 1}`
per rank on a CPU (`{"GPU": 1}` on CUDA), plus the Ray resources `--ray-resources` names, so
that nodes a `ray start --resources` tagged take the actors. A bundle no node could ever hold
is refused at once, naming the resources; one the cluster is only busy for is waited for.
"""

import json
import logging
import os
from pathlib import Path

from tinyserve import extras

logger = logging.getLogger(__name__)

PLACEMENT_TIMEOUT_S = 300.0  # a placement group the cluster could hold, but is busy for
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])  # the folder that holds tinyserve/
# What the actors need of this process's environment (Ray starts them in its own).
_ENV_PREFIXES = ("TINYSERVE_", "HF_", "OTEL_", "TRITON_", "TOKENIZERS_", "OMP_", "CUDA_")


def ray_installed() -> bool:
    return extras.installed("ray")


def check_ray(flag: str) -> None:
    """ValueError naming the flag, the ray extra and the command that installs it, when Ray is not installed."""
    if not ray_installed():
        raise ValueError(extras.missing_message(f"{flag} ray", "ray"))


BACKENDS = ("mp", "ray")  # --distributed-executor-backend, --data-parallel-backend (vLLM's names)


def check_distributed_args(args) -> None:
    """EngineArgs' distributed_executor_backend and ray_resources, checked (ValueError naming the field)."""
    if args.distributed_executor_backend not in BACKENDS:
        raise ValueError(f"distributed_executor_backend must be one of {list(BACKENDS)}, "
                         f"got {args.distributed_executor_backend!r}")
    if args.distributed_executor_backend == "ray":
        check_ray("--distributed-executor-backend")
        if getattr(args, "pipeline_parallel_size", 1) > 1:
            raise ValueError("--distributed-executor-backend ray places tensor-parallel ranks; with "
                             "--pipeline-parallel-size the stages run as processes: use mp")
        if args.tensor_parallel_size == 1:
            logger.warning("--distributed-executor-backend ray places tensor-parallel ranks 1..N-1: with "
                           "--tensor-parallel-size 1 there is none, and the engine runs as it would with mp")
    check_resources(args.ray_resources)


def check_resources(resources) -> None:
    if resources is None:
        return
    if not isinstance(resources, dict) or not all(
            isinstance(k, str) and k and isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0
            for k, v in resources.items()):
        raise ValueError(f"ray_resources (--ray-resources) must map resource names to positive amounts, "
                         f"e.g. {{\"node_b\": 1}}; got {resources!r}")
    taken = sorted(set(resources) & {"CPU", "GPU", "memory", "object_store_memory"})
    if taken:
        raise ValueError(f"ray_resources (--ray-resources) names {taken}: each actor takes its CPU or GPU "
                         "already; name custom resources only")


def connect(cpus_needed: int = 1):
    """Ray, joined to a cluster: RAY_ADDRESS's, this machine's `ray start` one, or a new local one
    (with logical CPUs enough for cpus_needed bundles of one CPU, whatever this machine has)."""
    import ray

    if not ray.is_initialized():
        quiet = dict(log_to_driver=False, logging_level=logging.WARNING)
        # Ray's own search (RAY_ADDRESS, then the address `ray start` leaves in its temp folder), made here
        # so that ray.init is handed an address: given "auto" instead, Ray 2.60 joined the cluster but lost
        # count of the actors' handles, and they died ("all references to the actor were removed").
        from ray._private.services import canonicalize_bootstrap_address

        address = canonicalize_bootstrap_address(None)
        try:
            if address is not None:
                ray.init(address=address, **quiet)
        except ConnectionError:
            if os.environ.get("RAY_ADDRESS"):
                raise  # the cluster named is not there: say so, rather than start another
            logger.warning("the Ray cluster last started on this machine (%s) is gone", address)
            address = None
        if address is None:  # no cluster to join: start one of this machine alone
            ray.init(num_cpus=max(cpus_needed, os.cpu_count() or 1), include_dashboard=False, **quiet)
            logger.info("started a local Ray cluster at %s", ray.get_runtime_context().gcs_address)
    os.environ["RAY_ADDRESS"] = ray.get_runtime_context().gcs_address  # for the processes started from here
    return ray


def node_ip() -> str:
    """This process's address as the Ray cluster knows it (where its actors can reach it)."""
    import ray

    return ray.util.get_node_ip_address()


def runtime_env() -> dict:
    """The environment an actor runs in: tinyserve importable as here, and the variables it reads."""
    env = {name: value for name, value in os.environ.items() if name.startswith(_ENV_PREFIXES)}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_PACKAGE_ROOT, os.environ.get("PYTHONPATH")) if p)
    return {"env_vars": env}


def check_reachable(host: str) -> None:
    """ValueError naming --data-parallel-address when the sockets are bound on loopback but the cluster
    has nodes on other machines, whose engines could never connect to them."""
    import ipaddress

    import ray

    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return  # a host name: it may well be reachable
    others = sorted({node["NodeManagerAddress"] for node in ray.nodes() if node["Alive"]} - {node_ip()})
    if loopback and others:
        raise ValueError(f"--data-parallel-address {host} is this machine's loopback, which the Ray nodes at "
                         f"{', '.join(others)} cannot reach: give this machine's address on their network "
                         f"(Ray knows it as {node_ip()})")


def device_bundle(device_type: str, resources: dict | None) -> dict:
    """One rank's bundle: a CPU, or a GPU on CUDA, plus the Ray resources --ray-resources names."""
    return {"GPU" if device_type == "cuda" else "CPU": 1.0, **(resources or {})}


def placement_group(bundles: list[dict], strategy: str, name: str):
    """A placement group of these bundles, ready; ValueError at once if no node could hold one of them."""
    import ray
    from ray.util.placement_group import placement_group as make

    if strategy == "STRICT_PACK":  # every bundle on one node: that node must hold their sum
        _check_feasible([{key: sum(b.get(key, 0) for b in bundles) for key in set().union(*bundles)}])
    _check_feasible(bundles)
    group = make(bundles, strategy=strategy, name=name)
    ready, _ = ray.wait([group.ready()], timeout=PLACEMENT_TIMEOUT_S)
    if not ready:
        ray.util.remove_placement_group(group)
        raise RuntimeError(f"the Ray cluster did not place {name} ({json.dumps(bundles)}, {strategy}) within "
                           f"{PLACEMENT_TIMEOUT_S:.0f} s: its resources are taken (see `ray status`)")
    return group


def _check_feasible(bundles: list[dict]) -> None:
    import ray

    nodes = [node["Resources"] for node in ray.nodes() if node["Alive"]]
    for bundle in bundles:
        if not any(all(node.get(key, 0) >= amount for key, amount in bundle.items()) for node in nodes):
            held = sorted({key for node in nodes for key in node if not key.startswith("node:")})
            raise ValueError(f"no node of the Ray cluster has the resources of the bundle {json.dumps(bundle)} "
                             f"(--ray-resources, --tensor-parallel-size); its nodes have {held}; "
                             "see `ray status`")
