"""One pipeline stage's model runner: receive the stream, run this stage's layers, send it on.

    stage 0                 stage i                         last stage
    embed, layers ──send──► recv (wait), layers ──send──►   recv (wait), layers, norm,
                            (hidden, residual)              logits, sample

The model runner's seams carry it; `execute_model` is the plain one. `_forward` receives
the previous stage's hidden states and residual stream (not on stage 0), runs the model
(this stage's layers, models/pipeline_parallel.py) and sends the result to the next stage
(not on the last). `_outputs` samples on the last stage only; the others return nothing,
and learn the sampled tokens from the next SchedulerOutput (`update_states` reads
`new_token_ids`, which the pipeline scheduler fills), as vLLM's workers do.

The point-to-point transfer is torch.distributed's send/recv (gloo on a CPU, NCCL on
CUDA): each rank sends to the same tensor-parallel rank of the next stage. The send is
asynchronous (isend), so a stage is free for its next batch as soon as its layers are
done; it waits for a send to complete only before the next one.
"""

import time

import torch
import torch.distributed as dist

from tinyserve.engine.core.scheduler_output import SchedulerOutput
from tinyserve.engine.worker.model_runner import ModelInputs, ModelRunner, ModelRunnerOutput
from tinyserve.models.pipeline_parallel import PipelineStage


class StageLink:
    """This rank's two neighbours: the same tensor-parallel rank one stage before and one stage after."""

    def __init__(self, stage: PipelineStage, tp_rank: int, tp_size: int, hidden_size: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.previous = (stage.rank - 1) * tp_size + tp_rank if not stage.is_first else None
        self.next = (stage.rank + 1) * tp_size + tp_rank if not stage.is_last else None
        self.hidden_size, self.dtype, self.device = hidden_size, dtype, device
        self.recv_wait_s = 0.0  # summed over the stage's life: how long it waited for the previous stage
        self._sending: tuple[dist.Work, torch.Tensor] | None = None

    def recv(self, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The previous stage's (hidden, residual) for this step's num_tokens tokens."""
        started = time.perf_counter()
        stream = torch.empty((2, num_tokens, self.hidden_size), dtype=self.dtype, device=self.device)
        dist.recv(stream, src=self.previous)
        self.recv_wait_s += time.perf_counter() - started
        return stream[0], stream[1]

    def send(self, hidden: torch.Tensor, residual: torch.Tensor) -> None:
        self.wait_sent()
        stream = torch.stack([hidden, residual])  # one message; kept alive until it is sent
        self._sending = (dist.isend(stream, dst=self.next), stream)

    def wait_sent(self) -> None:
        if self._sending is not None:
            self._sending[0].wait()
            self._sending = None


class PipelineStageRunner(ModelRunner):
    """A ModelRunner over one stage's layers (the model was built with its PipelineStage)."""

    def __init__(self, model, *, link: StageLink, **kwargs) -> None:
        super().__init__(model, **kwargs)
        self.stage: PipelineStage = model.pp
        self.link = link

    def update_states(self, scheduler_output: SchedulerOutput) -> None:
        """The plain update; a stage that does not sample appends the tokens the last stage sampled."""
        super().update_states(scheduler_output)
        if self.stage.is_last:
            return
        for cached in scheduler_output.scheduled_cached_requests:
            state = self.requests[cached.request_id]
            missing = cached.num_computed_tokens + cached.num_new_tokens - len(state.prompt_token_ids) \
                - len(state.output_token_ids)
            if missing > 0:
                state.output_token_ids += cached.new_token_ids[len(cached.new_token_ids) - missing:]

    def _forward(self, inputs: ModelInputs) -> torch.Tensor | None:
        intermediate = None if self.stage.is_first else self.link.recv(len(inputs.input_ids))
        out = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.metadata, intermediate)
        if self.stage.is_last:
            return out
        self.link.send(*out)
        return None

    def _outputs(self, hidden, inputs: ModelInputs, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        if not self.stage.is_last:
            return ModelRunnerOutput({}, {})  # the last stage samples; this one learns its tokens next step
        return super()._outputs(hidden, inputs, scheduler_output)

    @torch.inference_mode()
    def warm_up(self) -> None:
        """ModelRunner.warm_up's dummy prompt, through the pipeline: every stage runs it, each receiving
        from the one before, so the first real batch pays no one-time cost on any stage."""
        scheduler_output = self.warm_up_step()
        dummy = scheduler_output.scheduled_new_requests[0]
        self.update_states(scheduler_output)
        inputs = self.prepare_inputs(scheduler_output)
        hidden = self._forward(inputs)
        if hidden is not None:
            self.model.compute_logits(hidden[inputs.logits_indices])
        self.link.wait_sent()
        self.update_states(SchedulerOutput(step_id=0, finished_request_ids=[dummy.request_id]))
