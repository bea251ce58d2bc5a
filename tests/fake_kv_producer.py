"""A producer's side channel that misbehaves, in a process of its own: `python -m tests.fake_kv_producer`.

It holds the shared secret of its environment (TINYSERVE_KV_TRANSFER_SECRET), so it completes the
CURVE handshake as a real prefill engine would, prints the port it listens on, and answers each pull
as its request id says:

    nan-*       every layer's blocks, the right size, all NaN
    short-*     every layer one byte short
    huge-N      one frame of N bytes after the reply (zero pages: it costs this process little memory
                until the CURVE encryption reads it)
    silent-*    no answer, ever
"""

import sys

import msgspec
import numpy as np
import zmq

from tinyserve.distributed.kv_transfer.metadata import SIDE_CHANNEL_MESSAGE, PullReply, PullRequest
from tinyserve.distributed.kv_transfer.trust import SideChannelKeys, shared_secret

ELEMENT_BYTES = {"torch.float32": 4, "torch.float16": 2, "torch.bfloat16": 2}
NAN = {"torch.float32": np.array(np.nan, np.float32), "torch.float16": np.array(np.nan, np.float16),
       "torch.bfloat16": np.array(0x7FC0, np.uint16)}


def layer_frames(pull: PullRequest, short: bool) -> list[bytes]:
    layout = pull.layout
    elements = 2 * len(pull.block_ids) * layout.block_size * layout.num_kv_heads * layout.head_dim
    nan = np.full(elements, NAN[layout.dtype]).tobytes()
    return [nan[:-1] if short else nan for _ in range(layout.num_layers)]


def answer(pull: PullRequest) -> list | None:
    kind = pull.request_id.split("-")[0]
    if kind == "silent":
        return None
    if kind == "huge":
        return [memoryview(np.zeros(int(pull.request_id.split("-")[1]), np.uint8))]
    return layer_frames(pull, short=kind == "short")


def main() -> None:
    keys, context = SideChannelKeys(shared_secret()), zmq.Context()
    authenticator = keys.start_authenticator(context)
    socket = context.socket(zmq.ROUTER)
    keys.serve(socket)
    print(socket.bind_to_random_port("tcp://127.0.0.1"), flush=True)
    decoder, encoder = msgspec.msgpack.Decoder(SIDE_CHANNEL_MESSAGE), msgspec.msgpack.Encoder()
    try:
        while True:
            identity, payload = socket.recv_multipart()
            pull = decoder.decode(payload)
            frames = answer(pull) if isinstance(pull, PullRequest) else None
            if frames is not None:
                reply = PullReply(num_bytes=sum(len(frame) for frame in frames))
                socket.send_multipart([identity, encoder.encode(reply), *frames], copy=False)
    finally:
        authenticator.stop()


if __name__ == "__main__":
    sys.exit(main())
