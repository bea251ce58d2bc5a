"""Plug KV cache events into an engine (`--kv-events-config`), at two seams the step does not see.

    block pool     its event sink: the recorder (recorder.py) hears of every block cached or evicted
    recorder       an end hook: after each step the events are drained, handed to the publisher's
                   thread as one KVEventBatch, and counted on the step span (schema.STEP_KV_EVENTS)
    shutdown       a close hook: what is queued is sent, the socket closed

EngineCore calls this once, while it builds the engine; the step itself does not change.
A prefix-cache reset between steps (reset_prefix_cache) goes out after the next step.
"""

import time

from tinyserve.kv_events.config import KVEventsConfig
from tinyserve.kv_events.events import KVEventBatch
from tinyserve.kv_events.recorder import KVEventRecorder


def attach_kv_events(engine) -> KVEventRecorder | None:
    """The engine's recorder of KV events, publishing when the config says so; None if events are off."""
    from tinyserve.lifecycle import schema

    config = KVEventsConfig.from_dict(engine.args.kv_events_config)
    if not config.enable_kv_cache_events:
        return None
    medium = "GPU" if engine.args.torch_device.type == "cuda" else "CPU"  # vLLM's name for its device pool
    recorder = KVEventRecorder(engine.args.block_size, medium)
    engine.kv_cache_manager.pool.event_sink = recorder
    publisher = None
    if config.publishes:
        from tinyserve.kv_events.publisher import ZmqEventPublisher

        publisher = ZmqEventPublisher(config, data_parallel_rank=engine.engine_index)
        engine.recorder.close_hooks.append(publisher.shutdown)

    def after_step(record) -> dict:
        events = recorder.drain()
        if events and publisher is not None:
            publisher.publish(KVEventBatch(ts=time.time(), events=events))
        return {schema.STEP_KV_EVENTS: len(events)}

    engine.recorder.end_hooks.append(after_step)
    return recorder
