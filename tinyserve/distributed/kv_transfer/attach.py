"""Plug a KV connector into an engine, at its seams (`--kv-transfer-config`).

    scheduler      KVConnectorScheduler with the connector's scheduler side (scheduler.py)
    model runner   KVConnectorModelRunner with its worker side (model_runner.py)
    engine         a request check: kv_transfer_params this engine's role can serve, well formed
    recorder       a prefill hook: the prompt tokens whose K/V arrived, on the consumer's prefill span
                   (the KV transfer span itself comes from the transfer threads: spans.py); a close hook

EngineCore picks the classes while it builds the engine, as it does for --speculative-config; the
step itself does not change.
"""

import functools

from tinyserve.distributed.kv_transfer.config import KVTransferConfig
from tinyserve.distributed.kv_transfer.connector_scheduler import KVConnectorSchedulerSide
from tinyserve.distributed.kv_transfer.model_runner import KVConnectorModelRunner
from tinyserve.distributed.kv_transfer.params import check_kv_transfer_params
from tinyserve.distributed.kv_transfer.scheduler import KVConnectorScheduler


def kv_transfer_classes(args):
    """(scheduler class, runner class) of an engine with a KV connector."""
    config = KVTransferConfig.from_dict(args.kv_transfer_config)
    scheduler_class = functools.partial(KVConnectorScheduler,
                                        connector=KVConnectorSchedulerSide(config, args.block_size))
    runner_class = functools.partial(KVConnectorModelRunner, kv_transfer_config=config)
    return scheduler_class, runner_class


def attach_kv_transfer(engine) -> None:
    from tinyserve.lifecycle import schema

    scheduler, worker = engine.scheduler.connector, engine.model_runner.connector
    scheduler.side_channel = worker.address  # what a finished prefill's kv_transfer_params name
    engine.scheduler.transfers_ended = worker.has_finished_transfers
    worker.on_finished = lambda: engine.wake_loop()  # an idle engine process steps to free or admit
    engine.request_checks.append(lambda request: check_kv_transfer_params(
        scheduler.config, engine.args.block_size, request.prompt_token_ids, request.sampling_params))

    def prefill_attributes(request_id: str) -> dict:
        received = engine.scheduler.num_received_tokens.pop(request_id, None)
        return {} if received is None else {schema.KV_TRANSFER_NUM_RECEIVED_TOKENS: received}

    engine.recorder.prefill_hooks.append(prefill_attributes)
    engine.recorder.close_hooks.append(worker.close)  # the side channel, the pulls, the transfer engine
