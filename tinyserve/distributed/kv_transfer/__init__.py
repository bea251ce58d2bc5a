"""Disaggregated prefill: a KV connector moves a prompt's K/V from a prefill engine to a decode engine.

vLLM's interface (KVConnectorBase_V1), in two halves, each plugged in at a seam of its side:

    connector_scheduler.py   the scheduler side: how many of a new request's tokens arrive from elsewhere,
                             what to send and receive this step (SchedulerOutput.kv_connector_metadata),
                             whether a finished request's blocks wait for a send
    scheduler.py             KVConnectorScheduler: the base Scheduler, with a request whose K/V are arriving
                             held in WAITING_FOR_REMOTE_KVS and a producer's finished blocks kept until pulled
    connector_worker.py      the worker side: a side channel that serves pulls of held blocks, pulls of its
                             own into freshly allocated blocks, and which completed (get_finished)
    transports.py            how the blocks' bytes move: Mooncake's transfer engine, or ZeroMQ frames
    model_runner.py          KVConnectorModelRunner: the connector's calls around execute_model
    attach.py                the classes EngineCore builds, the request check, the spans

The step itself does not change: EngineCore picks the classes while it builds the engine.
"""
