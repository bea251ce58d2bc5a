"""--distributed-executor-backend ray: tensor-parallel ranks 1..N-1 as Ray actors.

Rank 0 stays in the engine process, beside the scheduler, as with processes; the other ranks
are RankActors placed by one placement group of N bundles, one per rank (PACK: on as few
nodes as the cluster allows, across nodes when one cannot hold them all). Bundle 0 is rank
0's, pinned to the engine's own node; the others carry the resources of --ray-resources.
An engine that is itself a Ray actor (--data-parallel-backend ray) already sits in bundle 0
of its own placement group, made for all its ranks (ray_engines.py): its ranks take bundles
1..N-1 of that one. Each rank then does exactly what a rank process does (run_worker): it
joins rank 0's store at the engine node's Ray address, forms the gloo (or NCCL) group and
runs every step it is sent over ZeroMQ.
"""

import logging

from tinyserve.config import EngineArgs
from tinyserve.distributed.actor_process import ActorProcess
from tinyserve.distributed.actors import CONCURRENCY_GROUPS, RankActor
from tinyserve.distributed.ray_cluster import connect, device_bundle, node_ip, placement_group, runtime_env

logger = logging.getLogger(__name__)


class RayRanks:
    parent_pid = None  # an actor dies with its owner, the engine process: no watch of a parent

    def __init__(self, args: EngineArgs, engine_index: int) -> None:
        self.ray = ray = connect(cpus_needed=args.tensor_parallel_size)
        self.host = node_ip()
        self.device_type = args.torch_device.type
        self.own_group = None
        group = ray.util.get_current_placement_group()
        if group is None or len(group.bundle_specs) < args.tensor_parallel_size:
            bundles = [device_bundle(self.device_type, args.ray_resources)
                       for _ in range(args.tensor_parallel_size)]
            bundles[0] = {**device_bundle(self.device_type, None), f"node:{self.host}": 0.001}  # rank 0: here
            group = self.own_group = placement_group(bundles, "PACK", f"tinyserve-engine-{engine_index}-tp")
        self.group = group

    def start(self, rank: int, name: str, target, kwargs: dict) -> ActorProcess:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        on_gpu = self.device_type == "cuda"
        actor = self.ray.remote(concurrency_groups=CONCURRENCY_GROUPS)(RankActor).options(
            name=None, num_cpus=0 if on_gpu else 1, num_gpus=1 if on_gpu else 0, runtime_env=runtime_env(),
            scheduling_strategy=PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=rank),
        ).remote(name)
        return ActorProcess(actor, name, actor.where.remote(), actor.run.options(name=name).remote(target, kwargs))

    def shutdown(self) -> None:
        if self.own_group is not None:
            self.ray.util.remove_placement_group(self.own_group)
            self.own_group = None
