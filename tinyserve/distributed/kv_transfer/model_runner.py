"""KVConnectorModelRunner: the base ModelRunner with a KV connector's worker side around each step.

    bind_connector_metadata + start_load_kv   before the forward pass: this step's sends and receives
    execute_model                             the base one, unchanged
    wait_for_save + get_finished              after it: the transfers that completed, in ModelRunnerOutput

A step with nothing scheduled (the engine steps only because transfers are under way) waits up to
IDLE_WAIT_S for one to end, rather than spin.
"""

from tinyserve.distributed.kv_transfer.config import KVTransferConfig
from tinyserve.distributed.kv_transfer.connector_worker import KVConnectorWorkerSide
from tinyserve.engine.core.scheduler_output import SchedulerOutput
from tinyserve.engine.worker.model_runner import ModelRunner, ModelRunnerOutput

IDLE_WAIT_S = 0.02


class KVConnectorModelRunner(ModelRunner):
    def __init__(self, *args, kv_transfer_config: KVTransferConfig, on_transfer_finished, **kwargs) -> None:
        """on_transfer_finished(): a transfer ended, from its thread (wakes an idle engine process's loop)."""
        super().__init__(*args, **kwargs)
        self.connector = KVConnectorWorkerSide(kv_transfer_config, self.kv_caches, self.block_size,
                                               on_transfer_finished)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        connector = self.connector
        connector.bind_connector_metadata(scheduler_output.kv_connector_metadata)
        connector.start_load_kv()
        output = super().execute_model(scheduler_output)
        connector.wait_for_save()
        output.kv_connector_output = connector.get_finished(
            scheduler_output.finished_request_ids, IDLE_WAIT_S if scheduler_output.is_empty else 0.0)
        connector.clear_connector_metadata()
        return output
