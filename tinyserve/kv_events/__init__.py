"""KV cache events, as vLLM publishes them: which blocks an engine holds, for a router to read.

    config.py     KVEventsConfig: vLLM's --kv-events-config fields, checked
    events.py     the wire format: KVEventBatch of BlockStored, BlockRemoved, AllBlocksCleared (msgspec)
    recorder.py   KVEventRecorder: the block pool's event sink, drained into events after each step
    publisher.py  ZmqEventPublisher: a PUB socket and its own thread, [topic, sequence, payload]
    layer.py      the layer: plugs the three into an engine as it is assembled, at seams the step does not see

The rest of tinyserve meets this layer at two seams: the block pool's event sink, given when
it is built (the pool says when a block gets a hash, loses it, or all are cleared), and the
engine's post-step hooks (run after every step, traced or not). See docs/design.md, "KV cache events".
"""
