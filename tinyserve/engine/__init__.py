"""The API-process side of the engine: render, enqueue, IPC, detokenize."""
