"""Tensor parallelism across processes: rank 0 beside the scheduler, ranks 1..N-1 as its children.

    engine process                                     worker process, rank r = 1 .. N-1
    ┌─────────────────────────────────┐  SchedulerOutput ┌──────────────────────────────┐
    │ Scheduler.schedule()            │ ─ ZeroMQ PUSH ─► │ ModelRunner (rank r's shard) │
    │ TensorParallelRunner            │   msgpack bytes  │   execute_model(output)      │
    │   send the output to each rank  │                  │                              │
    │   ModelRunner (rank 0's shard)  │ ◄─ all_reduce ─► │   (two per layer, and the    │
    │   execute_model(output)         │  torch.distributed│   same sampled tokens)       │
    │ Scheduler.update_from_output()  │  gloo / NCCL     │                              │
    └─────────────────────────────────┘                  └──────────────────────────────┘

Rank 0 lives in the engine process, as in vLLM's uniprocess-plus-workers layout: the
scheduler and rank 0's model runner need nothing between them, and one process fewer
stands between a step and its result. Each step, the SchedulerOutput (the whole of what a
worker learns, see scheduler_output.py) is encoded once with msgspec and pushed to every
other rank; each rank runs its shard of the same forward pass, the all-reduces inside it
making the ranks wait for one another. Every rank samples the same tokens from the same
logits and seeds (the LM head is replicated, tensor_parallel.py), so each keeps its own
request state; rank 0's tokens are the step's.

The process group is set up by rendezvous on a torch.distributed TCPStore that rank 0
hosts: an address and a port are all a rank needs, so ranks could be on other hosts.
A rank that dies breaks the next collective on the others: the engine's step raises and
the engine fails every request, as when an engine process dies. A rank that lives but does
not answer is made one that died by tp_watchdog.py.

With one rank (EngineArgs.force_tensor_parallel) no process starts: the group is rank 0
alone, and the same layers call the same all-reduce, a collective of one.
"""

import contextlib
import json
import os
import signal
import threading
import time
from pathlib import Path

import msgspec
import setproctitle
import torch
import torch.distributed as dist
import zmq

from tinyserve.config import EngineArgs, ModelInfo
from tinyserve.engine.worker.rank_launchers import ProcessRanks
from tinyserve.engine.worker.tp_group import RENDEZVOUS_TIMEOUT_S, host_store, join_group, join_store, rank_device
from tinyserve.engine.worker.tp_watchdog import CollectiveWatchdog
from tinyserve.engine.core.scheduler_output import SchedulerOutput
from tinyserve.lifecycle.engine_records import RankTimes
from tinyserve.lifecycle.tracing import tracing_enabled
from tinyserve.models.tensor_parallel import split_heads, split_width

STARTUP_POLL_S = 0.05  # how often rank 0 looks for the others, and for one that died, before it joins
_STOP = b"stop"


def check_devices(args: EngineArgs) -> None:
    if args.torch_device.type == "cuda" and args.tensor_parallel_size > torch.cuda.device_count():
        raise ValueError(f"tensor_parallel_size ({args.tensor_parallel_size}) is more than the "
                         f"{torch.cuda.device_count()} CUDA device(s) of this machine: one rank per device")


def check_split(model_path, size: int) -> None:
    """ValueError naming the numbers if the checkpoint's heads or MLP width do not split over `size` ranks."""
    config = json.loads((Path(model_path) / "config.json").read_text())
    heads = config["num_attention_heads"]
    split_heads(heads, config.get("num_key_value_heads") or heads, size, 0)
    split_width(config["intermediate_size"], size, "intermediate_size")


def bind_socket(context: zmq.Context, kind: int, host: str) -> tuple[zmq.Socket, str]:
    """A socket of `kind` bound to a free port on `host`, and its address for the ranks to connect to."""
    socket = context.socket(kind)
    socket.setsockopt(zmq.LINGER, 0)
    socket.bind(f"tcp://{host}:0")
    return socket, socket.getsockopt_string(zmq.LAST_ENDPOINT)


def bind_rank_sockets(context: zmq.Context, host: str, size: int) -> tuple[list[zmq.Socket], list[str]]:
    """One PUSH socket per rank 1..size-1, through which rank 0 hands each its steps; and their addresses."""
    bound = [bind_socket(context, zmq.PUSH, host) for _ in range(1, size)]
    return [socket for socket, _ in bound], [address for _, address in bound]


class TensorParallelWorkers:
    """Rank 0's side: start ranks 1..N-1, join the group, then send each step to them."""

    def __init__(self, args: EngineArgs, model_info: ModelInfo, engine_index: int, launcher=None) -> None:
        """launcher: what starts ranks 1..N-1 (a layer's: Ray actors); None: this process's children."""
        check_devices(args)
        if dist.is_initialized():  # torch.distributed has one default group per process
            raise ValueError("a tensor-parallel engine is already running in this process: shut it down first "
                             "(LLM.shutdown())")
        check_split(model_info.path, args.tensor_parallel_size)  # before any process starts
        self.size = args.tensor_parallel_size
        launcher = self._launcher = launcher or ProcessRanks()  # processes, or Ray actors
        host = launcher.host
        store = self._store = host_store(host, self.size)
        self._context = zmq.Context()
        self._sockets, addresses = bind_rank_sockets(self._context, host, self.size)
        # Each rank's clock of a step comes back here, for the step span (only when tracing).
        self._times, times_address = bind_socket(self._context, zmq.PULL, host)
        self.traced = tracing_enabled()
        self.last_rank_times: list[RankTimes] | None = None  # the latest step's, rank 0 first, when tracing
        self.device = str(rank_device(args, engine_index, 0))
        num_threads = None
        if args.torch_device.type == "cpu":  # each rank its share of the cores, or --cpu-threads each
            num_threads = args.cpu_threads or max(1, (os.cpu_count() or 1) // self.size)
        self.processes = []
        for rank, address in zip(range(1, self.size), addresses):
            self.processes.append(launcher.start(rank, f"tinyserve-engine-{engine_index}-tp{rank}", run_worker, dict(
                args=args, model_info=model_info, engine_index=engine_index, rank=rank, host=host, port=store.port,
                address=address, times_address=times_address, parent_pid=launcher.parent_pid,
                num_threads=num_threads)))
        self._threads_before = torch.get_num_threads()
        if num_threads is not None:
            torch.set_num_threads(num_threads)  # rank 0 shares the cores with the others (until shutdown)
        self._wait_for_ranks()
        self.tp = join_group(0, self.size, store, rank_device(args, engine_index, 0))
        self._encoder = msgspec.msgpack.Encoder()
        self.watchdog_s = args.tensor_parallel_watchdog_s
        self.watchdog: CollectiveWatchdog | None = None  # watch(), once every rank has warmed up

    def watch(self) -> None:
        """Start the collective watchdog. Not before warm-up: rank 0 meets the others' first all_reduce
        only once each has loaded its shard, which on a slow machine takes longer than the bound."""
        if self.watchdog_s > 0 and self.processes:
            self.watchdog = CollectiveWatchdog(self.tp.timer, self.processes, self.watchdog_s)

    def _wait_for_ranks(self) -> None:
        """Until every rank is about to join the group; RuntimeError at once if one has died. (Joining
        waits for every rank, up to RENDEZVOUS_TIMEOUT_S, and cannot be interrupted: so each rank first
        writes its key in rank 0's store, and rank 0 joins once all are there, watching the ranks.)"""
        keys = [_started_key(rank) for rank in range(1, self.size)]
        deadline = time.monotonic() + RENDEZVOUS_TIMEOUT_S
        while not self._store.check(keys):
            for rank, process in enumerate(self.processes, start=1):
                if process.exitcode is not None:
                    self.shutdown()
                    raise RuntimeError(f"tensor-parallel rank {rank} exited during start-up "
                                       f"({_exit_reason(process)}); its error is above")
            if time.monotonic() > deadline:
                self.shutdown()
                raise RuntimeError(f"tensor-parallel ranks did not start within {RENDEZVOUS_TIMEOUT_S} s")
            time.sleep(STARTUP_POLL_S)

    def start(self, num_blocks: int) -> None:
        """Tell every rank how many KV blocks to allocate (the scheduler's, the same on every rank),
        and whether to send its clock back each step."""
        for socket in self._sockets:
            socket.send(self._encoder.encode([num_blocks, self.traced]))

    @contextlib.contextmanager
    def clocked(self, scheduler_output: SchedulerOutput):
        """Around rank 0's execute: when tracing, every rank's clock of the step, rank 0 first."""
        timer, started = self.tp.timer, time.time()
        waited, self.last_rank_times = timer.seconds, None
        yield
        if self.traced and not scheduler_output.is_empty:
            own = RankTimes(0, self.device, started, time.time(), timer.seconds - waited)
            self.last_rank_times = [own, *self.receive_times()]

    def receive_times(self) -> list[RankTimes]:
        """Ranks 1..N-1's clocks of the step that just ran (each sends one as it finishes)."""
        times = [RankTimes(*msgspec.msgpack.decode(self._times.recv())) for _ in self.processes]
        return sorted(times, key=lambda t: t.rank)

    def send(self, scheduler_output: SchedulerOutput) -> None:
        """Push the step to every rank. A rank that has died fails the step with its name: a PUSH
        socket whose reader is gone would block, and the collective would wait for it."""
        for rank, process in enumerate(self.processes, start=1):
            if process.exitcode is not None:
                raise RuntimeError(f"tensor-parallel rank {rank} died ({_exit_reason(process)})")
        message = self._encoder.encode(scheduler_output)
        for socket in self._sockets:
            socket.send(message)

    def shutdown(self, timeout_s: float = 5.0) -> None:
        if getattr(self, "watchdog", None) is not None:
            self.watchdog.stop()
        for socket in self._sockets:
            with contextlib.suppress(zmq.ZMQError):
                socket.send(_STOP, flags=zmq.NOBLOCK)
        for process in self.processes:
            process.join(timeout_s)
            if process.exitcode is None:
                process.kill()
                process.join()
        self._context.destroy(linger=0)
        self._launcher.shutdown()
        if dist.is_initialized():
            dist.destroy_process_group()
        self._store = None  # closes rank 0's store and frees its port
        torch.set_num_threads(self._threads_before)


class TensorParallelRunner:
    """Rank 0's ModelRunner, with every step sent to the other ranks first."""

    def __init__(self, runner, workers: TensorParallelWorkers) -> None:
        self.runner = runner
        self.workers = workers

    def execute_model(self, scheduler_output: SchedulerOutput):
        self.workers.send(scheduler_output)
        try:
            with self.workers.clocked(scheduler_output):  # every rank's execute, for the step span
                return self.runner.execute_model(scheduler_output)
        except Exception as error:
            watchdog = self.workers.watchdog
            if watchdog is not None and watchdog.fired:  # the collective failed because the ranks were killed
                raise RuntimeError(watchdog.fired) from error
            raise

    @property
    def last_rank_times(self) -> list[RankTimes] | None:
        return self.workers.last_rank_times

    def warm_up(self) -> None:
        self.runner.warm_up()  # every rank warms up with the same dummy step: their collectives pair up
        self.workers.watch()  # every rank has answered once: from now on a silent one is stuck

    def __getattr__(self, name):  # requests, kv_caches, num_graph_steps, ...: rank 0's
        return getattr(self.runner, name)


def run_worker(args: EngineArgs, model_info: ModelInfo, engine_index: int, rank: int, host: str, port: int,
               address: str, times_address: str, parent_pid: int | None, num_threads: int | None) -> None:
    """Entry point of rank `rank`: join the group, load this rank's shard, run every step it is sent."""
    from tinyserve.engine.worker.model_runner import ModelRunner
    from tinyserve.kernels.backend import default_attention_backend, get_attention_backend
    from tinyserve.models.loader import load_model

    setproctitle.setproctitle(f"tinyserve-engine-{engine_index}-tp{rank}")
    if threading.current_thread() is threading.main_thread():  # a process; a Ray actor's calls run in threads
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # rank 0's engine decides when this stops
    if parent_pid is not None:  # a Ray actor dies with its owner, the engine process, without one
        threading.Thread(target=_watch_parent, args=(parent_pid,), name="parent-watchdog", daemon=True).start()
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    context = zmq.Context()
    socket = context.socket(zmq.PULL)
    socket.connect(address)
    device = rank_device(args, engine_index, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    store = join_store(host, port, args.tensor_parallel_size)
    store.set(_started_key(rank), "1")  # rank 0 joins once every rank is here (_wait_for_ranks)
    tp = join_group(rank, args.tensor_parallel_size, store, device)
    backend = get_attention_backend(args.attention_backend or default_attention_backend(device), device,
                                    model_info.max_model_len)
    model, _ = load_model(model_info.path, model_info.torch_dtype, device, backend,
                          max_model_len=model_info.max_model_len, tp=tp)
    message = socket.recv()
    if message == _STOP:  # rank 0 failed to start
        return
    num_blocks, traced = msgspec.msgpack.decode(message)
    times = context.socket(zmq.PUSH)
    times.connect(times_address)
    runner = ModelRunner(model, num_blocks=num_blocks, block_size=args.block_size, dtype=model_info.kv_cache_dtype,
                         device=device, seed=args.seed, max_num_seqs=args.max_num_seqs,
                         max_model_len=model_info.max_model_len)
    runner.warm_up()
    decoder, encoder = msgspec.msgpack.Decoder(SchedulerOutput), msgspec.msgpack.Encoder()
    try:
        while (message := socket.recv()) != _STOP:
            scheduler_output = decoder.decode(message)
            started, waited = time.time(), tp.timer.seconds
            runner.execute_model(scheduler_output)
            if traced and not scheduler_output.is_empty:
                times.send(encoder.encode([rank, str(device), started, time.time(), tp.timer.seconds - waited]))
    finally:
        context.destroy(linger=0)
        dist.destroy_process_group()


def _started_key(rank: int) -> str:
    return f"tinyserve/rank-{rank}-started"


def _exit_reason(process) -> str:
    """How a rank ended: its exit status or signal, or what a Ray actor's handle says (actor_process.py)."""
    if getattr(process, "reason", None):
        return process.reason
    code = process.exitcode
    return f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"


def _watch_parent(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(1.0)
    os._exit(1)  # the engine is gone: nobody will send another step
