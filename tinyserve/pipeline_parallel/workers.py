"""The pipeline's processes: stage 0's first rank beside the scheduler, every other rank a child process.

    engine process (rank 0)          child processes, rank = stage * TP + tp_rank
    ┌──────────────────────────┐     ┌───────────────────┐      ┌────────────────────────┐
    │ scheduler, batch queue   │─SO─►│ stage 1 .. N-2    │─SO─► │ last stage             │
    │ stage 0 (its layers)     │     │ recv, layers, send│      │ recv, layers, sample   │
    │        └── hidden ───────┼────►│                   │─────►│  └── tokens ──► rank 0 │
    └──────────────────────────┘     └───────────────────┘      └────────────────────────┘
       SO: each SchedulerOutput, pushed to every rank over ZeroMQ (msgspec), as under tensor parallelism
       hidden: (hidden, residual) by torch.distributed send/recv to the next stage (stage_runner.py)
       tokens: the last stage's ModelRunnerOutput, pushed back over ZeroMQ with every rank's clock

The ranks form one torch.distributed world of PP x TP processes, by rendezvous on a TCPStore
rank 0 hosts (worker/tp_group.py's); each stage's TP ranks are a group of their own, for
their all-reduces. With TP > 1 each stage is a tensor-parallel group as in
worker/tensor_parallel_workers.py (stage 0's ranks 1..TP-1 are child processes too). Only
the last stage's first rank reports the step's result; only when tracing does every rank
report its clock.
"""

import contextlib
import datetime
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
from tinyserve.engine.child_process import ChildProcess
from tinyserve.engine.core.scheduler_output import SchedulerOutput
from tinyserve.engine.worker.model_runner import ModelRunnerOutput
from tinyserve.engine.worker.tensor_parallel_workers import bind_rank_sockets, bind_socket, check_split
from tinyserve.engine.worker.tp_group import RENDEZVOUS_TIMEOUT_S, GroupTimer, host_store, join_store
from tinyserve.engine.worker.tp_watchdog import CollectiveWatchdog, rank_state
from tinyserve.lifecycle.engine_records import RankTimes
from tinyserve.lifecycle.tracing import tracing_enabled
from tinyserve.models.pipeline_parallel import PipelineStage
from tinyserve.models.tensor_parallel import TensorParallel
from tinyserve.pipeline_parallel.stage_runner import StageLink
from tinyserve.utils import sigint_ignored

POLL_S = 0.05  # how often rank 0, waiting, looks for a rank that died
STOP = b"stop"


class StageResult(msgspec.Struct, array_like=True):
    """What a rank sends back for one batch: its clock (when tracing) and, from the last stage's first
    rank, the batch's output."""

    step_id: int
    times: RankTimes | None
    output: ModelRunnerOutput | None


class Placement:
    """Where rank `rank` sits in the PP x TP grid, and its pipeline neighbours."""

    def __init__(self, args: EngineArgs, model_info: ModelInfo, engine_index: int, rank: int) -> None:
        config = json.loads((Path(model_info.path) / "config.json").read_text())
        self.rank, self.tp_size = rank, args.tensor_parallel_size
        self.world_size = args.pipeline_parallel_size * self.tp_size
        stage, self.tp_rank = divmod(rank, self.tp_size)
        self.stage = PipelineStage.of(stage, args.pipeline_parallel_size, config["num_hidden_layers"])
        device = args.torch_device
        self.device = torch.device("cuda", engine_index * self.world_size + rank) if device.type == "cuda" else device
        self.hidden_size, self.dtype = config["hidden_size"], model_info.torch_dtype

    def join(self, store: dist.TCPStore) -> tuple[TensorParallel | None, StageLink]:
        """Join the world, make every stage's tensor-parallel group (each rank must make all of them, in the
        same order), and return this rank's TensorParallel (None without TP) and its StageLink."""
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=store, rank=self.rank, world_size=self.world_size,
                                timeout=datetime.timedelta(seconds=RENDEZVOUS_TIMEOUT_S))
        tp = None
        if self.tp_size > 1:
            stages = range(self.stage.size)
            groups = [dist.new_group([s * self.tp_size + r for r in range(self.tp_size)]) for s in stages]
            timer = GroupTimer(groups[self.stage.rank])
            tp = TensorParallel(self.tp_rank, self.tp_size, timer.all_reduce, timer)
        link = StageLink(self.stage, self.tp_rank, self.tp_size, self.hidden_size, self.dtype, self.device)
        return tp, link

    def clock(self, started: float, tp: TensorParallel | None, all_reduce_before: float,
              link: StageLink, waited_before: float) -> RankTimes:
        all_reduce = tp.timer.seconds - all_reduce_before if tp is not None else 0.0
        return RankTimes(self.rank, str(self.device), started, time.time(), all_reduce, self.stage.rank,
                         link.recv_wait_s - waited_before)


class PipelineParallelWorkers:
    """Rank 0's side: start every other rank, join the world, then send each step to them and collect
    each batch's result."""

    def __init__(self, args: EngineArgs, model_info: ModelInfo, engine_index: int) -> None:
        if dist.is_initialized():  # torch.distributed has one default group per process
            raise ValueError("a tensor- or pipeline-parallel engine is already running in this process: "
                             "shut it down first (LLM.shutdown())")
        self.placement = Placement(args, model_info, engine_index, 0)  # checks the layers split, first
        if args.tensor_parallel_size > 1:
            check_split(model_info.path, args.tensor_parallel_size)
        if args.torch_device.type == "cuda" and self.placement.world_size * (engine_index + 1) > torch.cuda.device_count():
            raise ValueError(f"pipeline_parallel_size x tensor_parallel_size ({self.placement.world_size}) ranks "
                             f"need as many CUDA devices; this machine has {torch.cuda.device_count()}")
        self.size = self.placement.world_size
        self.stage = self.placement.stage
        self.traced = tracing_enabled()
        self.watchdog_s = args.tensor_parallel_watchdog_s  # a batch not back by then: a rank is stopped or stuck
        host = "127.0.0.1"
        self._store = host_store(host, self.size)
        self._context = zmq.Context()
        self._sockets, addresses = bind_rank_sockets(self._context, host, self.size)
        self._results, results_address = bind_socket(self._context, zmq.PULL, host)
        num_threads = None
        if args.torch_device.type == "cpu":  # each rank its share of the cores, or --cpu-threads each
            num_threads = args.cpu_threads or max(1, (os.cpu_count() or 1) // self.size)
        self.processes = []
        for rank, address in zip(range(1, self.size), addresses):
            process = ChildProcess(run_rank, name=f"tinyserve-engine-{engine_index}-pp{rank}", kwargs=dict(
                args=args, model_info=model_info, engine_index=engine_index, rank=rank, host=host,
                port=self._store.port, address=address, results_address=results_address, parent_pid=os.getpid(),
                num_threads=num_threads))
            with sigint_ignored():
                process.start()
            self.processes.append(process)
        self._threads_before = torch.get_num_threads()
        if num_threads is not None:
            torch.set_num_threads(num_threads)
        self._wait_for_ranks()
        self.tp, self.link = self.placement.join(self._store)
        self.watchdog: CollectiveWatchdog | None = None  # watch(), once every rank has warmed up
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(StageResult)
        self._arrived: dict[int, list[StageResult]] = {}  # step_id -> what has come back for it so far

    def _wait_for_ranks(self) -> None:
        """Until every rank is about to join; RuntimeError at once if one has died (as tensor parallelism's)."""
        keys = [started_key(rank) for rank in range(1, self.size)]
        deadline = time.monotonic() + RENDEZVOUS_TIMEOUT_S
        while not self._store.check(keys):
            self.check_alive("exited during start-up")
            if time.monotonic() > deadline:
                self.shutdown()
                raise RuntimeError(f"pipeline-parallel ranks did not start within {RENDEZVOUS_TIMEOUT_S} s")
            time.sleep(POLL_S)

    def check_alive(self, what: str = "died") -> None:
        for rank, process in enumerate(self.processes, start=1):
            if process.exitcode is not None:
                self.shutdown()
                raise RuntimeError(f"pipeline-parallel rank {rank} (stage {rank // self.placement.tp_size}) "
                                   f"{what} ({exit_reason(process.exitcode)})")

    def watch(self) -> None:
        """Stage 0's tensor-parallel peers hold rank 0 in its all-reduces, inside stage 0's part of a step, where
        receive's bound never looks: the collective watchdog watches there (as under tensor parallelism alone).
        Armed after the warm-up, whose first all-reduce waits for every rank to have loaded its layers."""
        if self.tp is not None and self.watchdog_s > 0:
            self.watchdog = CollectiveWatchdog(self.tp.timer, self.processes, self.watchdog_s)

    def start(self, num_blocks: int) -> None:
        """Tell every rank how many KV blocks to allocate (rank 0's count), and whether to report its clock."""
        for socket in self._sockets:
            socket.send(self._encoder.encode([num_blocks, self.traced]))

    def send(self, scheduler_output: SchedulerOutput) -> None:
        """Push the step to every other rank; a rank that has died fails the step, named."""
        self.check_alive()
        message = self._encoder.encode(scheduler_output)
        for socket in self._sockets:
            socket.send(message)

    def receive(self, step_id: int) -> tuple[ModelRunnerOutput, list[RankTimes]]:
        """The batch's output, and (when tracing) every other rank's clock of it, waiting for them."""
        needed = len(self.processes) if self.traced else 1  # every other rank's clock; one carries the output
        started = time.monotonic()
        while len(arrived := self._arrived.setdefault(step_id, [])) < needed:
            if self._results.poll(int(POLL_S * 1000 * 20)):
                result = self._decoder.decode(self._results.recv())
                self._arrived.setdefault(result.step_id, []).append(result)
                continue
            self.check_alive()
            if self.watchdog_s and (waited := time.monotonic() - started) > self.watchdog_s:
                raise self._not_answering(step_id, waited)
        del self._arrived[step_id]
        [output] = [r.output for r in arrived if r.output is not None]
        return output, [r.times for r in arrived if r.times is not None]

    def _not_answering(self, step_id: int, waited_s: float) -> RuntimeError:
        """A rank alive but silent (stopped, stuck) would hold the batch for ever: kill the ranks, name it."""
        states = {rank: rank_state(process) for rank, process in enumerate(self.processes, start=1)}
        silent = [f"rank {rank} (stage {rank // self.placement.tp_size}, {state})"
                  for rank, state in states.items() if state != "running"]
        for process in self.processes:
            if process.exitcode is None:
                process.kill()
        who = ", ".join(silent) or "a rank (all still running)"
        return RuntimeError(f"pipeline-parallel {who} did not answer: batch {step_id} was not back after "
                            f"{waited_s:.0f} s (--tensor-parallel-watchdog-timeout {self.watchdog_s:g} s); "
                            "the ranks were killed")

    def shutdown(self, timeout_s: float = 5.0) -> None:
        if getattr(self, "watchdog", None) is not None:
            self.watchdog.stop()
        for socket in self._sockets:
            with contextlib.suppress(zmq.ZMQError):
                socket.send(STOP, flags=zmq.NOBLOCK)
        for process in self.processes:
            process.join(timeout_s)
            if process.exitcode is None:
                process.kill()
                process.join()
        self.processes = []
        self._context.destroy(linger=0)
        if dist.is_initialized():
            dist.destroy_process_group()
        self._store = None
        torch.set_num_threads(self._threads_before)


def run_rank(args: EngineArgs, model_info: ModelInfo, engine_index: int, rank: int, host: str, port: int,
             address: str, results_address: str, parent_pid: int, num_threads: int | None) -> None:
    """Entry point of rank `rank`: join the world, load this stage's (shard of its) layers, run every step."""
    from tinyserve.kernels.backend import default_attention_backend, get_attention_backend
    from tinyserve.models.loader import load_model
    from tinyserve.pipeline_parallel.stage_runner import PipelineStageRunner

    setproctitle.setproctitle(f"tinyserve-engine-{engine_index}-pp{rank}")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # rank 0's engine decides when this stops
    threading.Thread(target=watch_parent, args=(parent_pid,), name="parent-watchdog", daemon=True).start()
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    placement = Placement(args, model_info, engine_index, rank)
    context = zmq.Context()
    socket = context.socket(zmq.PULL)
    socket.connect(address)
    if placement.device.type == "cuda":
        torch.cuda.set_device(placement.device)
    store = join_store(host, port, placement.world_size)
    store.set(started_key(rank), "1")
    tp, link = placement.join(store)
    device = placement.device
    backend = get_attention_backend(args.attention_backend or default_attention_backend(device), device,
                                    model_info.max_model_len)
    model, _ = load_model(model_info.path, model_info.torch_dtype, device, backend,
                          max_model_len=model_info.max_model_len, tp=tp, pp=placement.stage)
    message = socket.recv()
    if message == STOP:  # rank 0 failed to start
        return
    num_blocks, traced = msgspec.msgpack.decode(message)
    results = context.socket(zmq.PUSH)
    results.connect(results_address)
    runner = PipelineStageRunner(model, link=link, num_blocks=num_blocks, block_size=args.block_size,
                                 dtype=model_info.kv_cache_dtype, device=device, seed=args.seed,
                                 max_num_seqs=args.max_num_seqs, max_model_len=model_info.max_model_len)
    runner.warm_up()
    reports = placement.stage.is_last and placement.tp_rank == 0  # the one rank whose output is the step's
    decoder, encoder = msgspec.msgpack.Decoder(SchedulerOutput), msgspec.msgpack.Encoder()
    try:
        while (message := socket.recv()) != STOP:
            scheduler_output = decoder.decode(message)
            started, waited = time.time(), link.recv_wait_s
            all_reduced = tp.timer.seconds if tp is not None else 0.0
            output = runner.execute_model(scheduler_output)
            if scheduler_output.is_empty or not (reports or traced):
                continue
            times = placement.clock(started, tp, all_reduced, link, waited) \
                if traced else None
            results.send(encoder.encode(StageResult(scheduler_output.step_id, times, output if reports else None)))
    finally:
        link.wait_sent()
        context.destroy(linger=0)
        dist.destroy_process_group()


def started_key(rank: int) -> str:
    return f"tinyserve/pp-rank-{rank}-started"


def exit_reason(exitcode: int) -> str:
    return f"killed by {signal.Signals(-exitcode).name}" if exitcode < 0 else f"exit code {exitcode}"


def watch_parent(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(1.0)
    os._exit(1)  # the engine is gone: nobody will send another step
