"""Pipeline parallelism (`--pipeline-parallel-size N`): the model's layers split over N stages, each a
process (or a tensor-parallel group of them), with up to N batches in flight. Engine process and its
child processes; see docs/design.md."""
