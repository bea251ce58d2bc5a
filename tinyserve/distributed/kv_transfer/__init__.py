"""Disaggregated prefill: a KV connector moves a prompt's K/V from a prefill engine to a decode engine.

vLLM's interface (KVConnectorBase_V1), in two halves, each plugged in at a seam of its side:

    connector_scheduler.py   the scheduler side: how many of a new request's tokens arrive from elsewhere,
                             what to send and receive this step (SchedulerOutput.kv_connector_metadata),
                             whether a finished request's blocks wait for a send
    scheduler.py             KVConnectorScheduler: the base Scheduler, with a request whose K/V are arriving
                             held in WAITING_FOR_REMOTE_KVS and a producer's finished blocks kept until pulled
    connector_worker.py      the worker side: a side channel that serves pulls of held blocks, pulls of its
                             own into freshly allocated blocks, and which completed (get_finished)
    pull.py                  the consumer's pull: connect, ask, wait (bounded in time and in frame size)
    trust.py                 the secret every engine of a deployment shares: signed kv_transfer_params,
                             the side channel's CURVE keys
    transports.py            how the blocks' bytes move: Mooncake's transfer engine, or ZeroMQ frames
    model_runner.py          KVConnectorModelRunner: the connector's calls around execute_model
    layer.py                 the layer: its flags checked, the classes the assembly builds, the request
                             check, the spans

The step itself does not change: the assembly (tinyserve/assemble.py) builds the classes with the engine.
"""
