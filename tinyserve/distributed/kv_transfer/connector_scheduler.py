"""The scheduler side of a KV connector (vLLM's KVConnectorBase_V1, role SCHEDULER).

    get_num_new_matched_tokens   a new request with kv_transfer_params {"do_remote_prefill": true, ...}:
                                 all its prompt tokens arrive from the producer, asynchronously
    update_state_after_alloc     its blocks are allocated: pull the producer's blocks into them
    build_connector_meta         this step's receives and sends, for the worker side
    request_finished             a prefill asked for with {"do_remote_decode": true} that finished: keep its
                                 blocks for the consumer, and say where they are (kv_transfer_params,
                                 signed with the shared secret: trust.py);
                                 a request aborted while its blocks are being written: keep them until
                                 the worker side is done with them

Plain Python: the scheduler imports no torch.
"""

import time

from tinyserve.distributed.kv_transfer.config import KVTransferConfig
from tinyserve.distributed.kv_transfer.metadata import KVConnectorMetadata, RecvSpec, SendSpec, prompt_hash
from tinyserve.distributed.kv_transfer.trust import sign_params
from tinyserve.engine.core.request import Request, RequestStatus
from tinyserve.utils import cdiv


class KVConnectorSchedulerSide:
    def __init__(self, config: KVTransferConfig, block_size: int, side_channel: tuple[str, int]) -> None:
        """side_channel: the worker side's address, bound (what a finished prefill's kv_transfer_params name)."""
        self.config = config
        self.block_size = block_size
        self.side_channel = side_channel
        self._reqs_to_recv: list[RecvSpec] = []
        self._reqs_to_send: list[SendSpec] = []
        self.recving: set[str] = set()  # requests whose blocks a pull may be writing

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        """(tokens whose K/V will arrive from elsewhere, whether asynchronously): a remote prefill's whole prompt."""
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return 0, False
        count = request.num_prompt_tokens - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        if not num_external_tokens:
            return
        params = request.kv_transfer_params
        params["do_remote_prefill"] = False  # once: preempted later, the request recomputes its prompt here
        self._reqs_to_recv.append(RecvSpec(
            request.request_id, list(block_ids), params["remote_request_id"], list(params["remote_block_ids"]),
            params["remote_host"], params["remote_port"], prompt_hash(request.prompt_token_ids),
            request.num_prompt_tokens, request.trace_context))
        self.recving.add(request.request_id)

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        metadata = KVConnectorMetadata(self._reqs_to_recv, self._reqs_to_send)
        self._reqs_to_recv, self._reqs_to_send = [], []
        return metadata

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict | None]:
        """(whether its blocks stay allocated for now, the kv_transfer_params its output carries)."""
        if request.request_id in self.recving:  # aborted while its K/V arrive: freed once the pull ends
            return True, None
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_decode") or request.status is not RequestStatus.FINISHED_LENGTH:
            return False, None  # as vLLM: a prefill that stopped (EOS, a stop token) has nothing to hand over
        block_ids = block_ids[: cdiv(request.num_prompt_tokens, self.block_size)]
        fingerprint = prompt_hash(request.prompt_token_ids)
        self._reqs_to_send.append(SendSpec(request.request_id, block_ids, fingerprint,
                                           time.time() + self.config.abort_request_timeout, request.trace_context))
        host, port = self.side_channel
        params = {
            "do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": self.config.engine_id,
            "remote_host": host, "remote_port": port, "remote_block_ids": block_ids,
            "remote_request_id": request.request_id, "remote_num_tokens": request.num_prompt_tokens,
            "remote_prompt_hash": fingerprint, "kv_connector": self.config.kv_connector, "tp_size": 1,
        }
        if self.config.shared_secret is not None:  # without it the request was refused at the door (params.py)
            params["remote_signature"] = sign_params(self.config.shared_secret, params)
        return True, params
