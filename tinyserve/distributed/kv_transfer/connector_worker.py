"""The worker side of a KV connector (vLLM's KVConnectorBase_V1, role WORKER).

    producer                                         consumer
    start_load_kv: register the step's sends         start_load_kv: a thread pulls each new receive
    side channel (ZeroMQ ROUTER, a thread):  ◄─ PullRequest(request, blocks, prompt hash, layout)
      checks, replies with the blocks          ─► PullReply (+ a frame per layer, or Mooncake's addresses)
                                                  writes them into its blocks (or Mooncake reads them)
      frees on PullDone                        ◄─ PullDone
    get_finished: pulled, or past the deadline    get_finished: landed, or failed (why)

The blocks a pull reads belong to a finished request nobody else writes, and those it writes to a
request that is not scheduled until they land, so the threads never race the forward pass.

A pull fails, with a message naming the producer, when the producer's socket goes away (the process
died mid-transfer: the connection closes), when it cannot be reached, when the producer refuses it
(an unknown request, another prompt, another cache layout) or after transfer_timeout seconds. Its
blocks are freed on both sides: here when the failure is reported, there when the deadline
(abort_request_timeout) passes with nobody having pulled them.

The side channel admits only peers holding the shared secret (ZeroMQ CURVE with a ZAP handler:
trust.py), takes no frame over MAX_MESSAGE_BYTES (ZMQ_MAXMSGSIZE: libzmq drops the peer at the
frame's header), and drops a malformed message (a wrong frame count, bytes that are no message),
logged, and goes on serving. The consumer's side of a pull is pull.py.
"""

import collections
import concurrent.futures
import logging
import threading
import time

import msgspec
import torch
import zmq

from tinyserve.distributed.kv_transfer import spans
from tinyserve.distributed.kv_transfer.config import KVTransferConfig
from tinyserve.distributed.kv_transfer.metadata import (
    SIDE_CHANNEL_MESSAGE, KVConnectorMetadata, KVConnectorOutput, KVLayout, PullDone, PullReply, PullRequest,
    RecvSpec, SendSpec,
)
from tinyserve.distributed.kv_transfer.pull import MAX_MESSAGE_BYTES, pull_blocks
from tinyserve.distributed.kv_transfer.transports import TRANSPORTS, KVTransferError
from tinyserve.distributed.kv_transfer.trust import SECRET_ENV, SideChannelKeys

logger = logging.getLogger(__name__)

REGISTRATION_WAIT_S = 5.0  # a pull may come before the step that registers its request's send: it waits that long
REMEMBERED = 4096  # requests whose blocks were sent or freed, remembered to refuse a late pull with the reason
POLL_MS = 50  # how often the side channel looks at deadlines (and frees expired sends) when no message comes


class KVConnectorWorkerSide:
    def __init__(self, config: KVTransferConfig, kv_caches: list[torch.Tensor], block_size: int,
                 on_finished=lambda: None) -> None:
        """on_finished(): called from the transfer threads as one ends (the assembly's wake_loop: an idle
        engine process steps to free or admit)."""
        self.config = config
        cache = kv_caches[0]
        self.layout = KVLayout(len(kv_caches), block_size, cache.shape[3], cache.shape[4], str(cache.dtype))
        self.transport = TRANSPORTS[config.kv_connector](kv_caches, config.kv_ip)
        self.keys = SideChannelKeys(config.shared_secret)
        self.context = zmq.Context()
        self._authenticator = self.keys.start_authenticator(self.context)  # ZAP: only the secret's holders
        self.encoder = msgspec.msgpack.Encoder()
        self._lock = threading.Lock()
        self._landed = threading.Event()  # a transfer ended: an idle step stops waiting
        self._to_send: dict[str, SendSpec] = {}
        self._pulled_at: dict[str, tuple[float, int]] = {}  # request id -> (first pulled, bytes)
        self._gone: collections.OrderedDict[str, str] = collections.OrderedDict()  # request id -> why no blocks
        self._done = KVConnectorOutput([], [], {})
        self._metadata: KVConnectorMetadata | None = None
        self._pulls = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="kv-pull")
        self._server = self.context.socket(zmq.ROUTER)
        self.keys.serve(self._server)
        self._server.maxmsgsize = MAX_MESSAGE_BYTES
        port = config.kv_port or self._server.bind_to_random_port(f"tcp://{config.kv_ip}")
        if config.kv_port:
            self._server.bind(f"tcp://{config.kv_ip}:{port}")
        self.address = (config.kv_ip, port)
        self._stop = threading.Event()
        self.on_finished = on_finished
        self._thread = threading.Thread(target=self._serve, name="kv-side-channel", daemon=True)
        self._thread.start()
        if config.shared_secret is None:
            logger.warning("KV connector without %s: kv_transfer_params are refused (no K/V is handed out or "
                           "pulled); set it, the same, on every prefill and decode server", SECRET_ENV)

    # ---- vLLM's worker-side calls, around each step's forward pass ------------------------------

    def bind_connector_metadata(self, metadata: KVConnectorMetadata | None) -> None:
        self._metadata = metadata

    def start_load_kv(self) -> None:
        """Register the finished prefills to keep for their consumers; start pulling the new receives."""
        metadata = self._metadata
        if metadata is None:
            return
        with self._lock:
            self._to_send.update({spec.request_id: spec for spec in metadata.reqs_to_send})
        for spec in metadata.reqs_to_recv:
            self._pulls.submit(self._pull, spec)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing to wait for: a request is scheduled only once its K/V have landed, whole."""

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata) -> None:
        """Nothing to save: a producer's blocks stay in its own cache until pulled."""

    def wait_for_save(self) -> None:
        """Nothing to wait for (see save_kv_layer)."""

    def clear_connector_metadata(self) -> None:
        self._metadata = None

    def get_finished(self, finished_req_ids: list[str], wait_s: float = 0.0) -> KVConnectorOutput:
        """The sends and receives that completed since the last call; wait_s: how long an idle step may wait
        for one (rather than spin while a transfer runs)."""
        if wait_s and not self._landed.is_set():
            self._landed.wait(wait_s)
        with self._lock:
            done, self._done = self._done, KVConnectorOutput([], [], {})
            self._landed.clear()
        return done

    def has_finished_transfers(self) -> bool:
        """Whether get_finished has news: a step would free or admit something."""
        return self._landed.is_set()

    def close(self) -> None:
        """Stop the side channel; a pull still under way fails (its socket closes with the context). Once only."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(timeout=5)
        self._pulls.shutdown(wait=False, cancel_futures=True)
        self._authenticator.stop()
        self.context.term()
        self.transport.close()

    # ---- producer: the side channel ---------------------------------------------------------------

    def _serve(self) -> None:
        decoder = msgspec.msgpack.Decoder(SIDE_CHANNEL_MESSAGE)
        parked: list[tuple[float, bytes, PullRequest]] = []  # pulls that came before their request finished
        try:
            while not self._stop.is_set():
                if self._server.poll(POLL_MS) and (received := self._receive(decoder)) is not None:
                    identity, message = received
                    if isinstance(message, PullDone):
                        self._sent(message.request_id)
                    else:
                        parked.append((time.monotonic() + REGISTRATION_WAIT_S, identity, message))
                parked = [item for item in parked if not self._answered(*item)]
                self._expire_sends()
        finally:
            self._server.close(linger=0)

    def _receive(self, decoder) -> tuple[bytes, PullRequest | PullDone] | None:
        """(the peer's identity, its message); None for a malformed one, logged and dropped."""
        frames = self._server.recv_multipart()
        if len(frames) != 2:  # the peer's identity, then one message
            logger.warning("KV side channel: dropped a message of %d frames (a pull or a done is one)",
                           len(frames) - 1)
            return None
        try:
            return frames[0], decoder.decode(frames[1])
        except msgspec.DecodeError as error:
            logger.warning("KV side channel: dropped a malformed message: %s", error)
            return None

    def _answered(self, deadline: float, identity: bytes, pull: PullRequest) -> bool:
        """_answer, and an answer that fails is logged and dropped: the side channel goes on serving."""
        try:
            return self._answer(deadline, identity, pull)
        except Exception:  # noqa: BLE001 - one pull's failure (its consumer times out) must not end the thread
            logger.exception("KV side channel: could not answer the pull of request %s", pull.request_id)
            return True

    def _answer(self, deadline: float, identity: bytes, pull: PullRequest) -> bool:
        """Answer a pull if its request is registered (True); past its deadline, refuse it."""
        with self._lock:
            spec = self._to_send.get(pull.request_id)
            gone = self._gone.get(pull.request_id)
        if spec is None and gone is None and time.monotonic() < deadline:
            return False
        reply, frames = PullReply(error=self._refusal(spec, pull, gone)), []
        if reply.error is None:
            reply, frames = self.transport.reply(spec.block_ids)
            with self._lock:
                self._pulled_at.setdefault(pull.request_id, (time.time(), reply.num_bytes))
        self._server.send_multipart([identity, self.encoder.encode(reply), *frames], copy=False)
        return True

    def _refusal(self, spec: SendSpec | None, pull: PullRequest, gone: str | None) -> str | None:
        where = f"the prefill engine at {self.address[0]}:{self.address[1]}"
        if spec is None:
            return f"{where} holds no K/V for request {pull.request_id!r}: {gone or 'never prefilled there'}"
        if pull.kv_connector != self.config.kv_connector:
            return f"{where} uses {self.config.kv_connector}, this engine {pull.kv_connector}"
        if pull.layout != self.layout:
            return f"{where} has another KV cache layout: {self.layout}, this engine {pull.layout}"
        if pull.prompt_hash != spec.prompt_hash or pull.block_ids != spec.block_ids:
            return f"{where} prefilled another prompt for request {pull.request_id!r}"
        return None

    def _sent(self, request_id: str) -> None:
        with self._lock:
            spec = self._to_send.pop(request_id, None)
            pulled = self._pulled_at.pop(request_id, None)
            if spec is None:
                return
            self._forget(request_id, "pulled already")
            self._done.finished_sending.append(request_id)
            self._landed.set()
        self.on_finished()
        start, num_bytes = pulled or (time.time(), 0)
        spans.transfer_span("producer", spec, start, time.time(), len(spec.block_ids), num_bytes,
                            self.config.kv_connector, None)

    def _expire_sends(self) -> None:
        """vLLM's VLLM_NIXL_ABORT_REQUEST_TIMEOUT: blocks nobody pulled in time are freed."""
        now = time.time()
        with self._lock:
            expired = [spec for spec in self._to_send.values() if spec.deadline <= now]
            for spec in expired:
                del self._to_send[spec.request_id]
                self._pulled_at.pop(spec.request_id, None)
                self._forget(spec.request_id, f"freed, nobody having pulled them within "
                                              f"{self.config.abort_request_timeout:g} s (abort_request_timeout)")
                self._done.finished_sending.append(spec.request_id)
                self._landed.set()
        if expired:
            self.on_finished()
        for spec in expired:
            logger.warning("freeing the KV blocks of request %s: no decode engine pulled them within %.0f s",
                           spec.request_id, self.config.abort_request_timeout)
            spans.transfer_span("producer", spec, spec.deadline - self.config.abort_request_timeout, now,
                                len(spec.block_ids), 0, self.config.kv_connector, "expired: nobody pulled them")

    def _forget(self, request_id: str, why: str) -> None:
        self._gone[request_id] = why
        if len(self._gone) > REMEMBERED:
            self._gone.popitem(last=False)

    # ---- consumer: pulls ---------------------------------------------------------------------------

    def _pull(self, spec: RecvSpec) -> None:
        start, num_bytes, error = time.time(), 0, None
        try:
            num_bytes = pull_blocks(self, spec)
        except Exception as failure:  # noqa: BLE001 - whatever it was, the request fails with it, named
            error = str(failure) if isinstance(failure, KVTransferError) else f"{type(failure).__name__}: {failure}"
            error = f"the KV transfer from {spec.remote_host}:{spec.remote_port} failed: {error}"
        with self._lock:
            if error is None:
                self._done.finished_recving.append(spec.request_id)
            else:
                self._done.failed_recving[spec.request_id] = error
            self._landed.set()
        self.on_finished()
        spans.transfer_span("consumer", spec, start, time.time(), len(spec.local_block_ids), num_bytes,
                            self.config.kv_connector, error)
