"""--data-parallel-backend ray: the data-parallel engines as Ray actors, with EngineProcesses' face.

MPClient (frontend/core_client.py) binds one input socket per engine and one output socket,
starts the engines, and waits for each to say READY on the output socket. Here "starts" is:
one placement group per engine (STRICT_PACK: an engine and its tensor-parallel ranks on one
node, a bundle per rank, as vLLM places a data-parallel rank), and an EngineActor in bundle 0,
which runs the very loop an engine process runs (engine_core_proc.serve_engine) on the
sockets the client bound, over TCP at --data-parallel-address, as a headless node's engines
connect. Its tensor-parallel ranks, under --distributed-executor-backend ray, take the other
bundles (ray_ranks.py); under mp they are the actor's child processes.

With --trace, an engine on another machine writes into the same path there, with a
manifest of its own saying which node and rank it is, so `tinyserve trace merge` joins
that folder with the head's as it joins a headless node's.

Each actor is handed back as an ActorProcess (actor_process.py): its sentinel tells the
client's event loop the moment it dies, and the client fails its requests as for a process
(the server exits 1 unless --keep-alive-on-engine-death). On a CPU an engine takes
--cpu-threads threads, or as many as its node's cores give it (worker/cpu_threads.py).
"""

import logging
from dataclasses import asdict
from pathlib import Path

from tinyserve.config import EngineArgs, ModelInfo
from tinyserve.distributed.actor_process import ActorProcess
from tinyserve.distributed.actors import CONCURRENCY_GROUPS, EngineActor
from tinyserve.distributed.ray_cluster import check_reachable, connect, device_bundle, placement_group, runtime_env
from tinyserve.engine.engine_core_proc import EngineCoreProc, serve_engine
from tinyserve.lifecycle import schema
from tinyserve.lifecycle.tracing import host_name, write_manifest
from tinyserve.models.fingerprint import manifest_fingerprint

logger = logging.getLogger(__name__)

SHUTDOWN_TIMEOUT_S = 5.0  # stop(), then ray.kill after this long


class RayEngineActors:
    def __init__(self, args: EngineArgs, model_info: ModelInfo, num_engines: int, first_index: int = 0, *,
                 make_engine_core) -> None:
        """make_engine_core: what builds each engine in its actor (tinyserve/assemble.py's build_engine_core)."""
        self.args = args
        self.make_engine_core = make_engine_core
        self.model_info = model_info
        self.num_engines = num_engines
        self.first_index = first_index
        self.processes: list[ActorProcess] = []  # processes[i] serves rank first_index + i
        self.groups = []

    def start(self, input_addresses: list[str], output_address: str) -> None:
        """Place engine first_index + i reading requests from input_addresses[i]; all write to output_address."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        args, size = self.args, self.args.tensor_parallel_size
        ray = connect(cpus_needed=self.num_engines * size)
        check_reachable(output_address.removeprefix("tcp://").rsplit(":", 1)[0].strip("[]"))
        on_gpu = args.torch_device.type == "cuda"
        for engine_index, input_address in enumerate(input_addresses, start=self.first_index):
            name = f"tinyserve-engine-{engine_index}"
            group = placement_group([device_bundle(args.torch_device.type, args.ray_resources)] * size,
                                    "STRICT_PACK", name)
            self.groups.append(group)
            actor = ray.remote(concurrency_groups=CONCURRENCY_GROUPS)(EngineActor).options(
                num_cpus=0 if on_gpu else 1, num_gpus=1 if on_gpu else 0, runtime_env=runtime_env(),
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    group, placement_group_bundle_index=0, placement_group_capture_child_tasks=True),
            ).remote(name)
            where = actor.where.remote()  # before `run`, in its group: the two run one after the other
            run = actor.run.options(name=name).remote(EngineCoreProc, serve_engine_on_node, (engine_index, input_address, output_address),
                                   dict(args=args, make_engine_core=self.make_engine_core, model_info=self.model_info,
                                        num_threads=args.cpu_threads))
            self.processes.append(ActorProcess(actor, name, where, run))
        logger.info("%d engine(s) placed on the Ray cluster at %s", self.num_engines,
                    ray.get_runtime_context().gcs_address)

    def on_ready(self, pids: list[int]) -> None:
        """Nothing: each actor is watched from its start, through its handle."""

    @property
    def pids(self) -> list[int | None]:
        return [process.actor_pid for process in self.processes]

    def has_exited(self, position: int) -> bool:
        return self.processes[position].exitcode is not None

    def exit_reason(self, position: int) -> str:
        process = self.processes[position]
        return "still running" if process.reason is None else process.reason

    def terminate(self) -> None:
        for process in self.processes:
            process.terminate()

    def stop(self, timeout_s: float = SHUTDOWN_TIMEOUT_S) -> None:
        """Stop every engine (each flushes its spans), ray.kill one still there after timeout_s, free the groups."""
        self.terminate()
        for process in self.processes:
            process.join(timeout_s)
            process.kill()
        if self.groups:
            import ray

            for group in self.groups:
                ray.util.remove_placement_group(group)
            self.groups = []


def serve_engine_on_node(proc: EngineCoreProc, args: EngineArgs, make_engine_core, model_info: ModelInfo,
                         num_threads: int | None) -> None:
    """serve_engine in the actor; where the run folder is not there (another machine), it is made, with a manifest."""
    if args.trace_run_dir is not None and not (Path(args.trace_run_dir) / schema.MANIFEST_FILE).exists():
        run_dir = Path(args.trace_run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        write_manifest(run_dir, model=args.model, served_model_name=args.model or "", engine_args=asdict(args),
                       data_parallel_size=1, model_fingerprint=manifest_fingerprint(model_info.path),
                       node={"host": host_name(), "headless": True, "ranks": [proc.engine_index]})
    serve_engine(proc, args, make_engine_core, model_info, num_threads)
