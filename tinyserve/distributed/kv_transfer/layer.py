"""A KV connector as a layer of the engine (`--kv-transfer-config`), at its seams.

    check_args        the config's fields, and what a connector does not combine with (config.py)
    runner_class      KVConnectorModelRunner with its worker side (model_runner.py): the side channel
                      binds as the runner is built; a transfer that ends wakes an idle engine's loop
    scheduler_class   KVConnectorScheduler with the connector's scheduler side (scheduler.py), told the
                      worker side's address and asking it which transfers ended
    attach            a request check: kv_transfer_params this engine's role can serve, well formed;
                      prefill attributes: the prompt tokens whose K/V arrived, on the consumer's prefill
                      span (the KV transfer span itself comes from the transfer threads: spans.py);
                      a shutdown hook: the side channel, the pulls, the transfer engine

The assembly (tinyserve/assemble.py) builds the runner before the scheduler, so the scheduler's
side gets the worker side's address through its constructor; the step itself does not change.
"""

import functools

from tinyserve.distributed.kv_transfer.config import KVTransferConfig, check_engine_args
from tinyserve.engine.layers import AssemblyContext, EngineHooks, EngineLayer, EngineParts


class KVTransferLayer(EngineLayer):
    name = "kv_transfer"

    def check_args(self, args) -> None:
        if args.kv_transfer_config is not None:
            check_engine_args(args)

    def enabled(self, args) -> bool:
        return args.kv_transfer_config is not None

    def runner_class(self, ctx: AssemblyContext, runner_class):
        from tinyserve.distributed.kv_transfer.model_runner import KVConnectorModelRunner

        return functools.partial(KVConnectorModelRunner, kv_transfer_config=_config(ctx),
                                 on_transfer_finished=ctx.wake_loop)

    def scheduler_class(self, ctx: AssemblyContext, scheduler_class, model_runner):
        from tinyserve.distributed.kv_transfer.connector_scheduler import KVConnectorSchedulerSide
        from tinyserve.distributed.kv_transfer.scheduler import KVConnectorScheduler

        worker = model_runner.connector
        connector = KVConnectorSchedulerSide(_config(ctx), ctx.args.block_size, side_channel=worker.address)
        return functools.partial(KVConnectorScheduler, connector=connector,
                                 transfers_ended=worker.has_finished_transfers)

    def attach(self, ctx: AssemblyContext, engine_parts: EngineParts, hooks: EngineHooks) -> None:
        from tinyserve.distributed.kv_transfer.params import check_kv_transfer_params
        from tinyserve.lifecycle import schema

        scheduler, worker = engine_parts.scheduler, engine_parts.model_runner.connector
        config, block_size = scheduler.connector.config, ctx.args.block_size
        hooks.request_checks.append(lambda request: check_kv_transfer_params(
            config, block_size, request.prompt_token_ids, request.sampling_params))

        def prefill_attributes(request_id: str) -> dict:
            received = scheduler.finished_received_tokens.get(request_id)
            return {} if received is None else {schema.KV_TRANSFER_NUM_RECEIVED_TOKENS: received}

        hooks.prefill_attributes.append(prefill_attributes)
        hooks.shutdown.append(worker.close)  # the side channel, the pulls, the transfer engine


def _config(ctx: AssemblyContext) -> KVTransferConfig:
    return KVTransferConfig.from_dict(ctx.args.kv_transfer_config)
