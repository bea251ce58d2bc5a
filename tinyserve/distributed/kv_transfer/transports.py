"""How a block's bytes move from the producer's KV cache into the consumer's: two transports.

Blocks move whole, in the cache's dtype. Each layer's cache is one tensor [2 (K, V), num_blocks,
block_size, num_kv_heads, head_dim], so block b's keys are one contiguous run of bytes, and its
values another.

- MooncakeConnector (vLLM's name): Mooncake's transfer engine (`mooncake-transfer-engine-non-cuda`,
  the `[pd]` extra), over TCP, its metadata exchanged peer to peer (P2PHANDSHAKE: no metadata
  server). Both engines register their whole KV cache with it at start-up; the consumer reads the
  producer's blocks straight into its own (batch_transfer_sync_read), a run of bytes per block and
  K or V, with no copy in Python. Tried on a CPU-only machine: it loads once libibverbs is installed
  (Debian's libibverbs1; it looks for RDMA devices, finds none, and keeps to TCP), and two processes
  on loopback move a CPU buffer through it. NIXL, vLLM's default connector's library, was tried too:
  its PyPI package depends on its CUDA builds (nixl-cu12, nixl-cu13), so it is not used here.
- ZmqConnector: the blocks travel in the side channel's reply, one ZeroMQ frame per layer, gathered
  with one index_select and sent without a copy (copy=False); the consumer writes each frame into its
  blocks with index_copy_. Needs nothing but pyzmq: the default where Mooncake does not load.

What arrives is checked before a step can use it, or the prefix cache offer it to another request:
each layer's bytes are exactly its blocks' in this engine's layout, and the prompt's keys and values
are finite (check_received). A pull that fails the check fails its request, named.
"""

import warnings

import numpy as np
import torch

from tinyserve.distributed.kv_transfer.metadata import PullReply


class KVTransferError(Exception):
    """A pull that could not complete; its message is the request's error."""


def check_received(layer: int, blocks: torch.Tensor, num_tokens: int) -> None:
    """blocks: one layer's [2, num_blocks, block_size, num_kv_heads, head_dim]; its first num_tokens slots are
    the prompt's (the rest of the last block is whatever that cache held)."""
    if not torch.isfinite(blocks.flatten(1, 2)[:, :num_tokens]).all():
        raise KVTransferError(f"the K/V received for layer {layer} hold non-finite values (NaN or inf); "
                              f"they are not used")


def block_bytes(cache: torch.Tensor) -> int:
    """One block's keys (or values) of one layer."""
    return cache[0, 0].numel() * cache.element_size()


class ZmqTransport:
    name = "ZmqConnector"

    def __init__(self, kv_caches: list[torch.Tensor], host: str) -> None:
        self.kv_caches = kv_caches

    def max_frame_bytes(self, num_blocks: int) -> int:
        """The largest frame a pull of num_blocks may bring: one layer's blocks, K and V."""
        return 2 * num_blocks * max(block_bytes(cache) for cache in self.kv_caches)

    def reply(self, block_ids: list[int]) -> tuple[PullReply, list]:
        """The reply to a pull, and the frames that follow it: each layer's blocks, K then V."""
        index = torch.tensor(block_ids, device=self.kv_caches[0].device)
        frames = [memoryview(cache.index_select(1, index).cpu().view(torch.uint8).numpy()) for cache in self.kv_caches]
        return PullReply(num_bytes=sum(frame.nbytes for frame in frames)), frames

    def receive(self, reply: PullReply, frames: list, block_ids: list[int], remote_block_ids: list[int],
                num_tokens: int) -> int:
        """Every layer checked first (check_received), then written: refused K/V touch no block."""
        if len(frames) != len(self.kv_caches):
            raise KVTransferError(f"the producer sent {len(frames)} layers, this engine has {len(self.kv_caches)}")
        received = []
        for layer, (cache, frame) in enumerate(zip(self.kv_caches, frames)):
            shape = (2, len(block_ids), *cache.shape[2:])
            expected = 2 * len(block_ids) * block_bytes(cache)
            if frame.buffer.nbytes != expected:
                raise KVTransferError(f"the producer sent {frame.buffer.nbytes} bytes for layer {layer}; "
                                      f"{len(block_ids)} blocks of this engine's layout take {expected}")
            with warnings.catch_warnings():  # a read-only buffer: only read from, by index_copy_
                warnings.simplefilter("ignore", UserWarning)
                data = torch.from_numpy(np.frombuffer(frame.buffer, dtype=np.uint8)).view(cache.dtype).view(shape)
            check_received(layer, data, num_tokens)
            received.append(data)
        index = torch.tensor(block_ids, device=self.kv_caches[0].device)
        for cache, data in zip(self.kv_caches, received):
            cache.index_copy_(1, index, data.to(cache.device))
        return reply.num_bytes

    def close(self) -> None:
        pass


class MooncakeTransport:
    name = "MooncakeConnector"

    def __init__(self, kv_caches: list[torch.Tensor], host: str) -> None:
        from mooncake.engine import TransferEngine

        self.kv_caches = kv_caches
        self.engine = TransferEngine()
        if self.engine.initialize(host, "P2PHANDSHAKE", "tcp", "") != 0:
            raise RuntimeError(f"Mooncake's transfer engine could not start on {host} over TCP")
        for cache in kv_caches:
            if self.engine.register_memory(cache.data_ptr(), cache.numel() * cache.element_size()) != 0:
                raise RuntimeError("Mooncake's transfer engine could not register the KV cache")
        self.session = f"{host}:{self.engine.get_rpc_port()}"

    def max_frame_bytes(self, num_blocks: int) -> int:
        """No frame but the reply: the blocks are read through Mooncake's own connection."""
        return 0

    def reply(self, block_ids: list[int]) -> tuple[PullReply, list]:
        """Where the consumer reads from: this engine's transfer session and each layer's cache address."""
        num_bytes = sum(2 * len(block_ids) * block_bytes(cache) for cache in self.kv_caches)
        return PullReply(num_bytes=num_bytes, mooncake_session=self.session, num_blocks=self.kv_caches[0].shape[1],
                         layer_addresses=[cache.data_ptr() for cache in self.kv_caches]), []

    def receive(self, reply: PullReply, frames: list, block_ids: list[int], remote_block_ids: list[int],
                num_tokens: int) -> int:
        """Read straight into this engine's blocks, then checked there (check_received): blocks of a request
        whose K/V are arriving are neither scheduled nor in the prefix cache, and a failed pull frees them."""
        if len(reply.layer_addresses) != len(self.kv_caches):
            raise KVTransferError(f"the producer has {len(reply.layer_addresses)} layers, this engine "
                                  f"{len(self.kv_caches)}")
        local, remote, lengths = [], [], []
        for cache, remote_base in zip(self.kv_caches, reply.layer_addresses):
            size, num_blocks = block_bytes(cache), cache.shape[1]
            for half in (0, 1):  # K, then V
                for mine, theirs in zip(block_ids, remote_block_ids):
                    local.append(cache.data_ptr() + (half * num_blocks + mine) * size)
                    remote.append(remote_base + (half * reply.num_blocks + theirs) * size)
                    lengths.append(size)
        local, remote, lengths = merge_runs(local, remote, lengths)
        status = self.engine.batch_transfer_sync_read(reply.mooncake_session, local, remote, lengths)
        if status != 0:
            raise KVTransferError(f"Mooncake's read from {reply.mooncake_session} failed (status {status})")
        index = torch.tensor(block_ids, device=self.kv_caches[0].device)
        for layer, cache in enumerate(self.kv_caches):
            check_received(layer, cache.index_select(1, index), num_tokens)
        return sum(lengths)

    def close(self) -> None:
        for cache in self.kv_caches:
            self.engine.unregister_memory(cache.data_ptr())


def merge_runs(local: list[int], remote: list[int], lengths: list[int]) -> tuple[list[int], list[int], list[int]]:
    """Regions that follow each other on both sides become one: consecutive blocks are one read, not several."""
    merged = ([], [], [])
    for mine, theirs, length in zip(local, remote, lengths):
        if merged[0] and merged[0][-1] + merged[2][-1] == mine and merged[1][-1] + merged[2][-1] == theirs:
            merged[2][-1] += length
        else:
            for values, value in zip(merged, (mine, theirs, length)):
                values.append(value)
    return merged


TRANSPORTS = {transport.name: transport for transport in (MooncakeTransport, ZmqTransport)}
