"""What each backend's KV cache holds, kept up to date from its KV cache events.

One ZeroMQ SUB socket per backend (its --kv-events endpoint), read by an asyncio task in
the router's event loop. Each KVEventBatch is applied in order: BlockStored adds its block
hashes to the backend's set, BlockRemoved takes them out, AllBlocksCleared empties it.
A gap in the sequence numbers (a batch lost) is counted and logged: the set may then hold
a block the backend evicted, or miss one it holds, which costs a cache miss, never a wrong
answer. The router knows nothing of what a backend cached before it subscribed.
"""

import asyncio
import logging

import msgspec
import zmq
import zmq.asyncio

from tinyserve.kv_events.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

logger = logging.getLogger("tinyserve.router")


class KVIndex:
    def __init__(self, endpoints: list[str]) -> None:
        self.endpoints = endpoints
        self.held: list[set[int]] = [set() for _ in endpoints]  # per backend, the block hashes it holds
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
                held.update(event.block_hashes)
                for listener in self.listeners:
                    listener(index, event)
            elif isinstance(event, BlockRemoved):
                held.difference_update(event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                held.clear()
        self.batches[index] += 1
