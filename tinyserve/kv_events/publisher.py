"""ZmqEventPublisher: vLLM's publisher of KV event batches, on a ZeroMQ PUB socket of its own thread.

Every batch goes out as three frames, exactly as vLLM sends them:

    [topic (utf-8), sequence (8-byte big-endian, from 0), payload (msgpack KVEventBatch)]

The engine's loop only puts a batch on a queue; this thread encodes and sends it, so a slow
network never holds up a step. With a replay endpoint (a ROUTER socket) a subscriber that
saw a gap in the sequence asks for the batches from a number on, and gets each still kept
(the last buffer_steps) as [sequence, payload], then [-1, b""].
"""

import logging
import queue
import threading
from collections import deque
from itertools import count

import msgspec
import zmq

from tinyserve.kv_events.config import KVEventsConfig, bound_endpoint, offset_endpoint_port

logger = logging.getLogger("tinyserve.kv_events")

END_SEQ = (-1).to_bytes(8, "big", signed=True)


class ZmqEventPublisher:
    def __init__(self, config: KVEventsConfig, data_parallel_rank: int = 0) -> None:
        self.data_parallel_rank = data_parallel_rank
        self.endpoint = offset_endpoint_port(config.endpoint, data_parallel_rank)
        self.replay_endpoint = offset_endpoint_port(config.replay_endpoint, data_parallel_rank)
        self._topic = config.topic.encode("utf-8")
        self._queue: queue.Queue = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._context = zmq.Context.instance()
        self._pub = self._context.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        if any(mark in self.endpoint for mark in ("*", "::")) or self.endpoint.startswith(("ipc://", "inproc://")):
            # vLLM's rule: a wildcard or a local transport is bound; the wildcard on bind_host (loopback by default)
            self.endpoint = bound_endpoint(self.endpoint, config.bind_host)
            self._pub.setsockopt(zmq.IPV6, int("[" in self.endpoint))
            self._pub.bind(self.endpoint)
        else:
            self._pub.connect(self.endpoint)
        self._replay = None
        if self.replay_endpoint is not None:
            self.replay_endpoint = bound_endpoint(self.replay_endpoint, config.bind_host)
            self._replay = self._context.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.IPV6, int("[" in self.replay_endpoint))
            self._replay.bind(self.replay_endpoint)
        self._sequence = count()
        self._thread = threading.Thread(target=self._run, name="kv-events-publisher", daemon=True)
        self._thread.start()

    def publish(self, batch) -> None:
        """Queue a KVEventBatch (the engine loop's thread); dropped, with a warning, if the queue is full."""
        if batch.data_parallel_rank is None:
            batch.data_parallel_rank = self.data_parallel_rank
        try:
            self._queue.put_nowait(batch)
        except queue.Full:
            logger.warning("KV events: the publisher's queue is full; a batch was dropped")

    def shutdown(self, timeout: float = 1.0) -> None:
        """Send what is queued (for up to `timeout` seconds), then close the sockets."""
        self._queue.put(None)
        self._thread.join(timeout)
        self._pub.close(linger=int(timeout * 1000))
        if self._replay is not None:
            self._replay.close(linger=0)

    def _run(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        while True:
            if self._replay is not None and self._replay.poll(0):
                self._serve_replay()
            try:
                batch = self._queue.get(timeout=0.1)
            except queue.Empty:
                continue
            if batch is None:
                return
            sequence, payload = next(self._sequence), encoder.encode(batch)
            try:
                self._pub.send_multipart((self._topic, sequence.to_bytes(8, "big"), payload))
            except zmq.ZMQError as error:
                logger.warning("KV events: batch %d not sent: %s", sequence, error)
            self._buffer.append((sequence, payload))

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for sequence, payload in list(self._buffer):
            if sequence >= first:
                self._replay.send_multipart((client, b"", sequence.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_SEQ, b""))
