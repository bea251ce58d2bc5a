"""KV cache events as a layer of the engine (`--kv-events-config`), at two seams the step does not see.

    check_args        the config, read from a dict, JSON text or vLLM's KVEventsConfig, kept as a dict
    block_event_sink  the block pool's event sink: the recorder (recorder.py) hears of every block cached
                      or evicted
    attach            a post-step hook: after each step the events are drained, handed to the publisher's
                      thread as one KVEventBatch, and counted on the step span (schema.STEP_KV_EVENTS);
                      a shutdown hook: what is queued is sent, the socket closed

A prefix-cache reset between steps (reset_prefix_cache) goes out after the next step.
"""

import time

from tinyserve.engine.layers import AssemblyContext, EngineHooks, EngineLayer, EngineParts
from tinyserve.kv_events.config import KVEventsConfig


class KVEventsLayer(EngineLayer):
    name = "kv_events"

    def check_args(self, args) -> None:
        if args.kv_events_config is not None:  # a dict, JSON text, or vLLM's KVEventsConfig: kept as a dict
            args.kv_events_config = KVEventsConfig.from_any(args.kv_events_config).to_dict()

    def enabled(self, args) -> bool:
        return args.kv_events_config is not None and \
            KVEventsConfig.from_dict(args.kv_events_config).enable_kv_cache_events

    def block_event_sink(self, ctx: AssemblyContext):
        from tinyserve.kv_events.recorder import KVEventRecorder

        medium = "GPU" if ctx.args.torch_device.type == "cuda" else "CPU"  # vLLM's name for its device pool
        return KVEventRecorder(ctx.args.block_size, medium)

    def attach(self, ctx: AssemblyContext, engine_parts: EngineParts, hooks: EngineHooks) -> None:
        from tinyserve.kv_events.events import KVEventBatch
        from tinyserve.lifecycle import schema

        recorder = engine_parts.kv_cache_manager.pool.event_sink
        hooks.parts[self.name] = recorder
        config = KVEventsConfig.from_dict(ctx.args.kv_events_config)
        publisher = None
        if config.publishes:
            from tinyserve.kv_events.publisher import ZmqEventPublisher

            publisher = ZmqEventPublisher(config, data_parallel_rank=ctx.engine_index)
            hooks.shutdown.append(publisher.shutdown)

        def publish_events(record) -> dict:
            events = recorder.drain()
            if events and publisher is not None:
                publisher.publish(KVEventBatch(ts=time.time(), events=events))
            return {schema.STEP_KV_EVENTS: len(events)}

        hooks.post_step.append(publish_events)
