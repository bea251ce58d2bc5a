"""Engine process: the worker — input preparation, the forward pass and sampling, from a SchedulerOutput alone."""
