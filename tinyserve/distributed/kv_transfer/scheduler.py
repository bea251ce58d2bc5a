"""KVConnectorScheduler: the base Scheduler with a KV connector's scheduler side at its seams.

The two loops are the base Scheduler's, unchanged. Around them:

    schedule            first, each new request whose prompt K/V are elsewhere gets its blocks (not yet
                        offered to the prefix cache) and a pull, and waits in WAITING_FOR_REMOTE_KVS,
                        passed over by the waiting loop (an admission gate); last, the step's
                        KVConnectorMetadata goes into the SchedulerOutput
    update_from_output  the worker side's KVConnectorOutput: a landed request is WAITING again with
                        its prompt computed but the last token, which it recomputes to sample from
                        (as vLLM does); a failed pull fails its request, named; a send that completed
                        (or expired) frees the producer's blocks
    _computed_blocks    a landed request starts where its received K/V end
    _free_blocks        a finished request's blocks stay while a transfer uses them (request_finished)

    consumer:  WAITING ─alloc + pull─► WAITING_FOR_REMOTE_KVS ─landed─► WAITING ─► RUNNING (1 token computed)
    producer:  RUNNING ─max_tokens─► FINISHED_LENGTH, blocks held ─pulled or timed out─► freed
"""

from tinyserve.distributed.kv_transfer.connector_scheduler import KVConnectorSchedulerSide
from tinyserve.distributed.kv_transfer.metadata import KVConnectorOutput
from tinyserve.engine.core.request import Request, RequestStatus
from tinyserve.engine.core.scheduler import Scheduler
from tinyserve.engine.core.scheduler_output import SchedulerOutput
from tinyserve.wire.messages import EngineCoreOutput, SchedulerStats


def not_waiting_for_remote_kvs(request: Request, scheduler) -> bool:
    """An admission gate: a request whose K/V are still arriving keeps its place and is passed over."""
    return request.status is not RequestStatus.WAITING_FOR_REMOTE_KVS


class KVConnectorScheduler(Scheduler):
    def __init__(self, *args, connector: KVConnectorSchedulerSide, transfers_ended, **kwargs) -> None:
        """transfers_ended(): whether the worker side has transfers that ended, for the next step to free or
        admit (the connector's worker side's has_finished_transfers)."""
        super().__init__(*args, **kwargs)
        self.connector = connector
        self.admission_gates.append(not_waiting_for_remote_kvs)
        self.held: dict[str, Request] = {}  # finished, their blocks kept while a transfer uses them
        self._params_out: dict[str, dict] = {}  # a finished prefill's kv_transfer_params, for its output
        # A landed request's tokens it did not compute, while it runs; moved to finished_received_tokens as it
        # finishes, where the step's prefill span attributes read them (layer.py), kept until the next step.
        self.num_received_tokens: dict[str, int] = {}
        self.finished_received_tokens: dict[str, int] = {}
        self.transfers_ended = transfers_ended

    @property
    def has_finished_requests(self) -> bool:
        """Held blocks whose transfer ended count: a step frees them, even in an engine with nothing else to do."""
        return super().has_finished_requests or bool(self.held) and self.transfers_ended()

    def schedule(self) -> SchedulerOutput:
        self._start_remote_loads()
        output = super().schedule()
        output.kv_connector_metadata = self.connector.build_connector_meta(output)
        return output

    def _start_remote_loads(self) -> None:
        """New requests whose prompt K/V arrive from elsewhere: their blocks now, the pull with this step."""
        for request in self.waiting:
            if request.status is not RequestStatus.WAITING or request.kv_transfer_params is None:
                continue
            num_external, load_async = self.connector.get_num_new_matched_tokens(request, request.num_computed_tokens)
            if not num_external:
                continue
            if not self.kv.allocate_slots(request, num_external, delay_cache_blocks=True):
                return  # the pool is full: the next step tries again, in the queue's order
            self.connector.update_state_after_alloc(request, self.kv.get_block_ids(request.request_id), num_external)
            if load_async:
                request.status = RequestStatus.WAITING_FOR_REMOTE_KVS

    def _computed_blocks(self, request: Request) -> tuple[list, int]:
        if request.num_computed_tokens:  # its K/V landed: its blocks are in its table already
            return [], request.num_computed_tokens
        return super()._computed_blocks(request)

    def update_from_output(self, scheduler_output: SchedulerOutput, model_runner_output) -> list[EngineCoreOutput]:
        self.finished_received_tokens = {}
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        if model_runner_output.kv_connector_output is not None:
            outputs += self._update_from_kv_xfer_finished(model_runner_output.kv_connector_output)
        return outputs

    def _update_from_kv_xfer_finished(self, finished: KVConnectorOutput) -> list[EngineCoreOutput]:
        """Free what transfers held; landed requests become schedulable; failed pulls fail their requests."""
        outputs = []
        for request_id in finished.finished_sending:
            self._release(request_id)
        for request_id in [*finished.finished_recving, *finished.failed_recving]:
            self.connector.recving.discard(request_id)
            request = self.requests.get(request_id)
            if request is None:  # aborted while its K/V arrived
                self._release(request_id)
            elif request_id in finished.failed_recving:
                self.waiting.remove(request)
                self._finish(request, RequestStatus.FINISHED_ABORTED)
                output = self._output(request, [])
                output.error, output.error_param = finished.failed_recving[request_id], "kv_transfer_params"
                outputs.append(output)
            else:
                self._landed(request)
        return outputs

    def _landed(self, request: Request) -> None:
        """Its prompt's K/V are here: computed up to the last prompt token, recomputed to sample (vLLM's rule)."""
        request.num_computed_tokens = request.num_tokens - 1
        request.status = RequestStatus.WAITING
        self.num_received_tokens[request.request_id] = request.num_computed_tokens

    def abort_requests(self, request_ids: list[str]) -> list[EngineCoreOutput]:
        self.finished_received_tokens = {}
        return super().abort_requests(request_ids)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        received = self.num_received_tokens.pop(request.request_id, None)
        if received is not None:
            self.finished_received_tokens[request.request_id] = received
        super()._finish(request, status)

    def _release(self, request_id: str) -> None:
        request = self.held.pop(request_id, None)
        if request is not None:
            self.kv.free(request)

    def _free_blocks(self, request: Request) -> None:
        delay, params = self.connector.request_finished(request, self.kv.get_block_ids(request.request_id))
        if params is not None:
            self._params_out[request.request_id] = params
        if delay:
            self.held[request.request_id] = request
        else:
            super()._free_blocks(request)

    def _output(self, request: Request, new_token_ids: list[int], new_logprobs=None) -> EngineCoreOutput:
        output = super()._output(request, new_token_ids, new_logprobs)
        if request.is_finished:
            output.kv_transfer_params = self._params_out.pop(request.request_id, None)
        return output

    def add_request(self, request: Request) -> None:
        if request.request_id in self.held:  # its blocks are still the old request's
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        super().add_request(request)

    def make_stats(self) -> SchedulerStats:
        """Requests whose K/V are arriving are waiting, but not for room: vLLM's "deferred" waiting ones."""
        stats = super().make_stats()
        stats.num_waiting_deferred_reqs += sum(1 for r in self.waiting
                                               if r.status is RequestStatus.WAITING_FOR_REMOTE_KVS)
        return stats
