"""Engine process: the scheduler, the request state machine and the paged KV cache — plain Python, no torch."""
