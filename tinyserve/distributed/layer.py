"""Ray as a layer of the engine (`--distributed-executor-backend ray`, `--data-parallel-backend ray`).

    check_args      the Ray flags: Ray installed when asked for, the resources well formed, and what
                    they do not combine with (ray_cluster.py)
    rank_launcher   tensor-parallel ranks 1..N-1 as Ray actors in the engine's placement group
                    (ray_ranks.py), instead of the engine process's children

Data-parallel engines as Ray actors are the front end's choice (frontend/ray_client.py), not the engine's.
"""

from tinyserve.distributed.ray_cluster import check_distributed_args
from tinyserve.engine.layers import EngineLayer


class RayLayer(EngineLayer):
    name = "ray"

    def check_args(self, args) -> None:
        check_distributed_args(args)

    def enabled(self, args) -> bool:
        return args.distributed_executor_backend == "ray" and args.tensor_parallel_size > 1

    def rank_launcher(self, args, engine_index: int):
        from tinyserve.distributed.ray_ranks import RayRanks

        return RayRanks(args, engine_index)
