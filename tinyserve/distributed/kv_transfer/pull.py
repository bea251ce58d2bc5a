"""The consumer's pull: one request's blocks, from a producer's side channel into this engine's KV cache.

    connect (CURVE client, the peers' key pair: trust.py)  ─► PullRequest
    wait, at most transfer_timeout, for                    ◄─ PullReply (+ a frame per layer with ZeroMQ)
         or the connection failing (a socket monitor)
    the blocks checked and written (transports.py)         ─► PullDone

Where it connects was checked before the request was accepted: kv_transfer_params a prefill engine
sharing the secret signed (params.py). What comes back is bounded: ZeroMQ's ZMQ_MAXMSGSIZE socket
option (`socket.maxmsgsize`) makes libzmq drop the connection as soon as a frame's header announces
more bytes than one layer's blocks take, before it allocates them, so a frame too large never
reaches this process's memory. A message's frame count is not bounded by ZeroMQ (a multipart
message is delivered whole); only authenticated producers can send one.
"""

import contextlib
import time

import msgspec
import zmq
from zmq.utils.monitor import recv_monitor_message

from tinyserve.distributed.kv_transfer.metadata import PullDone, PullReply, PullRequest, RecvSpec
from tinyserve.distributed.kv_transfer.transports import KVTransferError
from tinyserve.distributed.kv_transfer.trust import SECRET_ENV

MAX_MESSAGE_BYTES = 1 << 20  # a side channel message other than the blocks: a pull, a done, a reply's header
HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                    | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
WATCHED_EVENTS = zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED | zmq.EVENT_CLOSED | HANDSHAKE_FAILED


def pull_blocks(worker, spec: RecvSpec) -> int:
    """Pull spec's blocks for `worker` (a KVConnectorWorkerSide); the bytes received, or a KVTransferError."""
    socket = worker.context.socket(zmq.DEALER)
    max_frame_bytes = max(MAX_MESSAGE_BYTES, worker.transport.max_frame_bytes(len(spec.local_block_ids)))
    socket.maxmsgsize = max_frame_bytes
    worker.keys.connect_as_client(socket)
    monitor = socket.get_monitor_socket(WATCHED_EVENTS)
    try:
        socket.connect(f"tcp://{spec.remote_host}:{spec.remote_port}")
        socket.send(worker.encoder.encode(PullRequest(spec.remote_request_id, spec.remote_block_ids,
                                                      spec.prompt_hash, worker.layout, worker.config.kv_connector)))
        frames = await_reply(socket, monitor, worker.config.transfer_timeout, max_frame_bytes)
        try:
            reply = msgspec.msgpack.decode(frames[0].bytes, type=PullReply)
        except msgspec.DecodeError as error:
            raise KVTransferError(f"the producer's reply is malformed: {error}") from None
        if reply.error is not None:
            raise KVTransferError(reply.error)
        num_bytes = worker.transport.receive(reply, frames[1:], spec.local_block_ids, spec.remote_block_ids,
                                             spec.num_tokens)
        socket.send(worker.encoder.encode(PullDone(spec.remote_request_id)))
        return num_bytes
    finally:
        with contextlib.suppress(zmq.ZMQError):  # the context may be ending (close): the sockets close all the same
            socket.disable_monitor()
        monitor.close(linger=0)
        socket.close(linger=1000)  # PullDone still leaves


def await_reply(socket: zmq.Socket, monitor: zmq.Socket, timeout: float, max_frame_bytes: int) -> list:
    """The reply's frames; a KVTransferError naming why none came: unreachable, not a peer, gone, too slow."""
    poller = zmq.Poller()
    poller.register(socket, zmq.POLLIN)
    poller.register(monitor, zmq.POLLIN)
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        ready = dict(poller.poll(left * 1000))
        if socket in ready:
            return socket.recv_multipart(copy=False)
        if monitor in ready:
            event = recv_monitor_message(monitor)["event"]
            if event == zmq.EVENT_CONNECT_RETRIED:
                raise KVTransferError("the prefill engine could not be reached")
            if event & HANDSHAKE_FAILED:
                raise KVTransferError(f"the peer there did not complete the CURVE handshake: it is not a prefill "
                                      f"engine sharing this engine's secret ({SECRET_ENV})")
            raise KVTransferError(f"the connection closed mid-transfer: the prefill engine went away, or sent a "
                                  f"frame over the {max_frame_bytes} bytes a layer's blocks take (ZMQ_MAXMSGSIZE)")
    raise KVTransferError(f"no answer within {timeout:g} s (transfer_timeout)")
