"""The pooling runner (`--runner pooling`): a step's hidden states become vectors, not tokens.

The forward pass is the generate runner's, unchanged: the same flattened batch, the same
paged KV cache, chunked prefill and all. Only what happens after it differs
(`_outputs`, the one method this class overrides): where the generate runner computes
logits at the last position of each request and samples, this one pools the request's
rows of the final hidden states (after the model's last norm) into one vector:

    hidden [T, hidden_size]   request A (chunk 2 of 2)      request B (whole prompt)
                              a8 a9 a10 a11                 b0 b1 b2
    LAST  (the default)                  a11 ──► vector               b2 ──► vector
    MEAN                      sum of a0..a11 / 12 (the sum carried over from chunk 1)
    CLS                       a0, kept from chunk 1
    then, unless the request or the server turned it off, divided by its L2 norm.

A request is done once its prompt has been computed: the scheduler sees the vector in
`ModelRunnerOutput.pooler_output` and finishes it (pooling_scheduler.py). It never decodes.

LAST is vLLM's default for decoder models: a causal model's last position is the only one
that has seen the whole text. MEAN and CLS need every position computed here, so the
engine turns the prefix cache off for them (config.py).
"""

import torch

from tinyserve.config import POOLING_TYPES
from tinyserve.engine.core.scheduler_output import SchedulerOutput
from tinyserve.engine.worker.model_runner import ModelInputs, ModelRunner, ModelRunnerOutput
from tinyserve.pooling_params import PoolingParams


class Pooler:
    """The server's pooling: which positions (pooling_type) and whether to L2-normalise by default."""

    def __init__(self, pooling_type: str = "LAST", normalize: bool = True) -> None:
        assert pooling_type in POOLING_TYPES  # EngineArgs checked --pooler-config
        self.pooling_type = pooling_type
        self.normalize = normalize

    def add_chunk(self, partial: torch.Tensor | None, rows: torch.Tensor, num_computed_tokens: int) -> torch.Tensor:
        """What is kept of the request's rows so far, with this step's chunk added (float32)."""
        rows = rows.float()
        if self.pooling_type == "LAST":
            return rows[-1]
        if self.pooling_type == "CLS":
            return rows[0] if num_computed_tokens == 0 else partial
        summed = rows.sum(dim=0)
        return summed if partial is None else partial + summed

    def finish(self, partial: torch.Tensor, num_tokens: int, params: PoolingParams) -> list[float]:
        """The request's vector, once every position has been added."""
        vector = partial / num_tokens if self.pooling_type == "MEAN" else partial
        normalize = self.normalize if params.normalize is None else params.normalize
        if normalize:
            vector = torch.nn.functional.normalize(vector, p=2, dim=-1)
        return vector.tolist()


class PoolingModelRunner(ModelRunner):
    def __init__(self, model, *, pooler: Pooler, **kwargs) -> None:
        super().__init__(model, **kwargs)
        self.pooler = pooler
        self.pooling_params: dict[str, PoolingParams] = {}  # of every request the worker holds
        self.partial: dict[str, torch.Tensor] = {}  # MEAN's running sum, CLS's first row, between chunks

    def update_states(self, scheduler_output: SchedulerOutput) -> None:
        super().update_states(scheduler_output)
        for request_id in scheduler_output.finished_request_ids:
            self.pooling_params.pop(request_id, None)
            self.partial.pop(request_id, None)
        for new in scheduler_output.scheduled_new_requests:  # new, or recomputed from its start after a preemption
            self.pooling_params[new.request_id] = new.pooling_params or PoolingParams()
            self.partial.pop(new.request_id, None)

    def _outputs(self, hidden: torch.Tensor, inputs: ModelInputs,
                 scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Each request's rows added to what was kept; the vector of each whose prompt is now computed."""
        pooled = {}
        first_row = 0
        for scheduled in scheduler_output.scheduled:
            rows = hidden[first_row : first_row + scheduled.num_new_tokens]
            first_row += scheduled.num_new_tokens
            request_id = scheduled.request_id
            partial = self.pooler.add_chunk(self.partial.get(request_id), rows, scheduled.num_computed_tokens)
            if scheduled.samples_token:  # the prompt's last position: done
                num_tokens = scheduled.num_computed_tokens + scheduled.num_new_tokens
                pooled[request_id] = self.pooler.finish(partial, num_tokens, self.pooling_params[request_id])
                self.partial.pop(request_id, None)
            else:
                self.partial[request_id] = partial
        return ModelRunnerOutput({}, {}, pooler_output=pooled)
