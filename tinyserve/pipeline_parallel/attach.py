"""Pipeline parallelism, plugged into EngineCore while it is built: three seams, no branch in the step.

- `start_workers`: every rank but this one starts and the world forms (workers.py), before
  this process loads stage 0's layers (`load_model(pp=workers.stage)`).
- `pipeline_classes`: the scheduler that skips requests in flight (scheduler.py) and the
  stage runner (stage_runner.py), chosen as `--runner pooling`'s classes are.
- `attach_pipeline`: stage 0's runner wrapped to submit batches (runner.py), and the
  engine's `step_fn` made the batch queue's step (batch_queue.py), as vLLM picks
  `step_with_batch_queue`.
"""

import functools

from tinyserve.pipeline_parallel.batch_queue import BatchQueue
from tinyserve.pipeline_parallel.runner import PipelineParallelRunner
from tinyserve.pipeline_parallel.scheduler import PipelineScheduler
from tinyserve.pipeline_parallel.stage_runner import PipelineStageRunner
from tinyserve.pipeline_parallel.workers import PipelineParallelWorkers


def start_workers(args, model_info, engine_index: int) -> PipelineParallelWorkers:
    return PipelineParallelWorkers(args, model_info, engine_index)


def pipeline_classes(workers: PipelineParallelWorkers):
    return PipelineScheduler, functools.partial(PipelineStageRunner, link=workers.link)


def attach_pipeline(engine) -> None:
    engine.model_runner = PipelineParallelRunner(engine.model_runner, engine.tp_workers)
    engine.step_fn = BatchQueue(engine, engine.args.pipeline_parallel_size).step
