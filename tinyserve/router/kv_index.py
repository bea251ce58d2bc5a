"""What each backend's KV cache holds, kept up to date from its KV cache events.

One ZeroMQ SUB socket per backend (its --kv-events endpoint), read by an asyncio task in
the router's event loop. Each KVEventBatch is applied in order: BlockStored adds its block
hashes to the backend's set, BlockRemoved takes them out, AllBlocksCleared empties it.
A gap in the sequence numbers (a batch lost) is counted and logged: the set may then hold
a block the backend evicted, or miss one it holds, which costs a cache miss, never a wrong
answer. The router knows nothing of what a backend cached before it subscribed.

What it holds per backend is bounded (--kv-index-max-blocks, 2^20 by default: about 100 MB):
past it the hashes stored longest ago are dropped first, as a backend whose events were lost
would be. A backend's KV pool holds far fewer blocks than that; only a publisher that stores
and never removes (or lies) reaches the bound, and then costs cache misses, not memory.
"""

import asyncio
import logging
from collections import OrderedDict

import msgspec
import zmq
import zmq.asyncio

from tinyserve.kv_events.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from tinyserve.router.defaults import DEFAULT_KV_INDEX_MAX_BLOCKS

logger = logging.getLogger("tinyserve.router")


class KVIndex:
    def __init__(self, endpoints: list[str], max_blocks: int = DEFAULT_KV_INDEX_MAX_BLOCKS) -> None:
        self.endpoints = endpoints
        self.max_blocks = max_blocks
        # per backend, the block hashes it holds, the most recently stored last
        self.held: list[OrderedDict[int, None]] = [OrderedDict() for _ in endpoints]
        self.dropped = [0] * len(endpoints)  # hashes dropped at the bound, per backend
        self.batches = [0] * len(endpoints)  # batches applied, per backend
        self.missed = [0] * len(endpoints)  # batches lost (gaps in the sequence), per backend
        self.listeners: list = []  # called (backend index, BlockStored) as each is applied (pending hashes)
        self._tasks: list[asyncio.Task] = []
        self._context: zmq.asyncio.Context | None = None

    async def start(self) -> None:
        self._context = zmq.asyncio.Context()
        for index, endpoint in enumerate(self.endpoints):
            socket = self._context.socket(zmq.SUB)
            socket.setsockopt(zmq.SUBSCRIBE, b"")  # every topic
            socket.connect(endpoint)
            self._tasks.append(asyncio.create_task(self._listen(index, socket), name=f"kv-events-{index}"))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._context is not None:
            self._context.destroy(linger=0)

    async def _listen(self, index: int, socket) -> None:
        decoder = msgspec.msgpack.Decoder(KVEventBatch)
        last = -1
        while True:
            frames = await socket.recv_multipart()
            if len(frames) != 3:
                continue
            sequence = int.from_bytes(frames[1], "big")
            if last >= 0 and sequence > last + 1:
                self.missed[index] += sequence - last - 1
                logger.warning("KV events of backend %d: %d batch(es) missed", index, sequence - last - 1)
            last = sequence
            try:
                batch = decoder.decode(frames[2])
            except msgspec.DecodeError as error:
                logger.warning("KV events of backend %d: a batch that does not decode: %s", index, error)
                continue
            self.apply(index, batch)

    def apply(self, index: int, batch: KVEventBatch) -> None:
        held = self.held[index]
        for event in batch.events:
            if isinstance(event, BlockStored):
                for block_hash in event.block_hashes:
                    held[block_hash] = None
                    held.move_to_end(block_hash)
                self._bound(index)
                for listener in self.listeners:
                    listener(index, event)
            elif isinstance(event, BlockRemoved):
                for block_hash in event.block_hashes:
                    held.pop(block_hash, None)
            elif isinstance(event, AllBlocksCleared):
                held.clear()
        self.batches[index] += 1

    def _bound(self, index: int) -> None:
        """Drop the hashes stored longest ago until at most max_blocks are left (logged the first time)."""
        held, over = self.held[index], len(self.held[index]) - self.max_blocks
        if over <= 0:
            return
        if self.dropped[index] == 0:
            logger.warning("KV events of backend %d: more than %d blocks held (--kv-index-max-blocks); "
                           "the oldest are dropped from the index", index, self.max_blocks)
        for _ in range(over):
            held.popitem(last=False)
        self.dropped[index] += over
