"""The engine client of one API process among several (`tinyserve serve --api-server-count N`).

The server's main process starts the engines and N API processes (cli/api_servers.py);
API process i runs this MPClient, vLLM's client with client_index i of client_count N:

- it starts no engine: the main process did, telling each engine the sockets of every
  API process; this one binds its own in the main process's socket directory, named
  `api-<i>-input-<e>` and `api-<i>-output` (ipc.client_socket_name);
- it stamps `client_index` on every request and utility call, so that each engine sends
  that request's outputs, and the call's answer, to this process alone
  (engine/client_outputs.py), while every API process gets every engine's stats;
- it watches the engines by the pids their handshakes carry (attached_engines.py): an
  engine that dies fails the requests this process sent it, as in a lone server.

Everything else (the least-loaded choice, a rank's death, utility calls) is MPClient's.
"""

from tinyserve.config import EngineArgs, ModelInfo
from tinyserve.frontend.attached_engines import AttachedEngines
from tinyserve.frontend.core_client import MPClient
from tinyserve.wire.ipc import client_socket_name


class APIServerClient(MPClient):
    def __init__(self, args: EngineArgs, model_info: ModelInfo, data_parallel_size: int, ipc_dir: str,
                 client_index: int, client_count: int) -> None:
        """ipc_dir: the main process's socket directory, where the engines look for this client's sockets."""
        if not 0 <= client_index < client_count:
            raise ValueError(f"client_index must be in [0, {client_count}), got {client_index}")
        super().__init__(args, model_info, data_parallel_size=data_parallel_size, ipc_dir=ipc_dir)
        self.client_index = client_index
        self.client_count = client_count
        self._engines = AttachedEngines()

    def _make_ipc_dir(self) -> str:
        return self._ipc_parent  # the main process's, removed by it

    def _bind(self, socket, name: str) -> None:
        super()._bind(socket, client_socket_name(name, self.client_index))
