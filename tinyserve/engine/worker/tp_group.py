"""The tensor-parallel process group: rendezvous through rank 0's TCPStore, then gloo or NCCL.

An address and a port are all a rank needs to find the group, so ranks could be on
other hosts (tensor_parallel_workers.py starts them on this one). GroupTimer wraps the
group's all_reduce to count how long each rank waited in collectives, for the step span.
"""

import datetime
import time

import torch
import torch.distributed as dist

from tinyserve.config import EngineArgs
from tinyserve.models.tensor_parallel import TensorParallel

RENDEZVOUS_TIMEOUT_S = 300  # ranks import torch and load their shard before they join


class GroupTimer:
    """The process group's all_reduce, timed: how long this rank waited in collectives, and since when it
    has been waiting in the current one (tp_watchdog.py's clue that a rank is not coming)."""

    def __init__(self, group=None) -> None:
        self.group = group  # None: the default group (all ranks); a stage's own under pipeline parallelism
        self.seconds = 0.0
        self.waiting_since: float | None = None  # time.monotonic() on entering all_reduce; None outside it

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        started = time.perf_counter()
        self.waiting_since = time.monotonic()
        dist.all_reduce(tensor, group=self.group)
        self.waiting_since = None
        self.seconds += time.perf_counter() - started
        return tensor


def host_store(host: str, size: int) -> dist.TCPStore:
    """Rank 0's TCP store, on a port the system picks as it binds (so no other process can take
    it between picking and binding); the other ranks are told `store.port`."""
    return dist.TCPStore(host, 0, world_size=size, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=RENDEZVOUS_TIMEOUT_S))


def join_store(host: str, port: int, size: int) -> dist.TCPStore:
    """A rank other than 0 finds the group by rank 0's store."""
    return dist.TCPStore(host, port, world_size=size, is_master=False,
                         timeout=datetime.timedelta(seconds=RENDEZVOUS_TIMEOUT_S))


def join_group(rank: int, size: int, store: dist.TCPStore, device: torch.device) -> TensorParallel:
    """Join the tensor-parallel process group through the store rank 0 hosts."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=store, rank=rank, world_size=size,
                            timeout=datetime.timedelta(seconds=RENDEZVOUS_TIMEOUT_S))
    timer = GroupTimer()
    return TensorParallel(rank, size, timer.all_reduce, timer)


def rank_device(args: EngineArgs, engine_index: int, rank: int) -> torch.device:
    """cuda:(engine_index * N + rank) on a GPU machine (one device per rank), else the CPU."""
    device = args.torch_device
    if device.type != "cuda":
        return device
    return torch.device("cuda", engine_index * args.tensor_parallel_size + rank)
