"""MPClient with its engines as Ray actors (--data-parallel-backend ray).

Everything of MPClient holds (core_client.py): the sockets, the load balancer, the handshake,
a dead engine failing only its own requests. Two things differ: the sockets are bound on TCP
at --data-parallel-address, since the engines may run on any node of the cluster, and the
engines are RayEngineActors (distributed/ray_engines.py) instead of processes.
"""

from tinyserve.assemble import build_engine_core
from tinyserve.config import EngineArgs, ModelInfo
from tinyserve.distributed.ray_engines import RayEngineActors
from tinyserve.frontend.core_client import MPClient


class RayMPClient(MPClient):
    def __init__(self, args: EngineArgs, model_info: ModelInfo, data_parallel_size: int, address: str) -> None:
        """data_parallel_size engines on the Ray cluster; address: where they reach this process."""
        super().__init__(args, model_info, data_parallel_size=data_parallel_size, transport="tcp")
        self.bind_host = address
        self._engines = RayEngineActors(args, model_info, data_parallel_size, make_engine_core=build_engine_core)
