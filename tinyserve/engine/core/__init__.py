"""The engine-process side: the busy loop, the scheduler and the KV cache manager."""
