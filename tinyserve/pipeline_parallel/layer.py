"""Pipeline parallelism as a layer of the engine (`--pipeline-parallel-size N`), at four seams; no branch in the step.

    check_args        the size, and the layers it does not combine with yet (config.py)
    start_ranks       every rank but this one starts and the world forms (workers.py), before this
                      process loads stage 0's layers (the assembly's `load_model(pp=ranks.stage)`)
    scheduler_class,  the scheduler that skips requests in flight (scheduler.py) and the stage runner
    runner_class      (stage_runner.py), as --runner pooling's classes are chosen
    wrap_runner       stage 0's runner wrapped to submit batches (runner.py)
    step_fn           the engine loop's step: the batch queue's (batch_queue.py), as vLLM picks
                      `step_with_batch_queue`
"""

import functools

from tinyserve.engine.layers import AssemblyContext, EngineLayer
from tinyserve.pipeline_parallel.config import check_pipeline_args


class PipelineParallelLayer(EngineLayer):
    name = "pipeline_parallel"

    def check_args(self, args) -> None:
        check_pipeline_args(args)

    def enabled(self, args) -> bool:
        return args.pipeline_parallel_size > 1

    def start_ranks(self, args, model_info, engine_index: int):
        from tinyserve.pipeline_parallel.workers import PipelineParallelWorkers

        return PipelineParallelWorkers(args, model_info, engine_index)

    def scheduler_class(self, ctx: AssemblyContext, scheduler_class, model_runner):
        from tinyserve.pipeline_parallel.scheduler import PipelineScheduler

        return PipelineScheduler

    def runner_class(self, ctx: AssemblyContext, runner_class):
        from tinyserve.pipeline_parallel.stage_runner import PipelineStageRunner

        return functools.partial(PipelineStageRunner, link=ctx.other_ranks.link)

    def wrap_runner(self, ctx: AssemblyContext, model_runner):
        from tinyserve.pipeline_parallel.runner import PipelineParallelRunner

        return PipelineParallelRunner(model_runner, ctx.other_ranks)

    def step_fn(self, engine):
        from tinyserve.pipeline_parallel.batch_queue import BatchQueue

        return BatchQueue(engine, engine.args.pipeline_parallel_size).step
