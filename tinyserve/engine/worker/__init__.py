"""The part of the engine that runs the model: input preparation, forward, sampling."""
