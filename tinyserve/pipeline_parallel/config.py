"""--pipeline-parallel-size checked with the rest of EngineArgs: its range, and what it is not combined with yet."""


def check_pipeline_args(args) -> None:
    """ValueError naming the flag: a size below 1, or pipeline parallelism with a layer it does not compose with."""
    size = args.pipeline_parallel_size
    if size < 1:
        raise ValueError(f"pipeline_parallel_size (--pipeline-parallel-size) must be at least 1, got {size}")
    if size == 1:
        return
    refused = [("enable_lora (--enable-lora)", args.enable_lora),
               ("speculative_config (--speculative-config)", args.speculative_config is not None),
               ("runner='pooling' (--runner pooling)", args.runner == "pooling" or args.convert == "embed"),
               ("kv_transfer_config (--kv-transfer-config)", args.kv_transfer_config is not None),
               ("force_tensor_parallel", args.force_tensor_parallel)]
    for name, given in refused:
        if given:
            raise ValueError(f"pipeline_parallel_size (--pipeline-parallel-size) > 1 is not supported with {name} yet")
