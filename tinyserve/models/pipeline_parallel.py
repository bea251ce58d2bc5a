"""Pipeline parallelism inside the model: which layers a stage holds (vLLM's split), and what it hands on.

N stages run the model's layers one after another, each over its own contiguous slice,
every stage the whole width of its layers (tensor parallelism splits within a layer;
this splits between layers):

    stage 0                       stage 1                      stage N-1
    embed_tokens                  layers[4:8]                  layers[..]
    layers[0:4]   ─ hidden, ───►  (received)      ─ ... ───►   norm, lm_head
                    residual                                   (the logits, sampled)

The split is vLLM's `get_pp_indices`: layers // N each, and the remainder goes one layer
at a time to the stages before the last, starting from the one before it, so the last
stage (which also holds the norm, the LM head and the sampler) gets no extra layer:
3 layers over 2 stages is [0:2] and [2:3]. A layer that lives on another stage is a
`PPMissingLayer` here, so a stage's module names still read `layers.5...` as the
checkpoint's do, and the loader skips what belongs to other stages.
"""

from dataclasses import dataclass

from torch import nn


def get_pp_indices(num_hidden_layers: int, pp_rank: int, pp_size: int) -> tuple[int, int]:
    """[start, end) of the layers stage `pp_rank` of `pp_size` holds (vLLM's vllm/distributed/utils.py)."""
    layers_per_partition = num_hidden_layers // pp_size
    partitions = [layers_per_partition for _ in range(pp_size)]
    if remaining_layers := num_hidden_layers % pp_size:
        for i in range(2, remaining_layers + 2):
            partitions[-i] += 1
    start_layer = sum(partitions[:pp_rank])
    return start_layer, start_layer + partitions[pp_rank]


@dataclass(frozen=True)
class PipelineStage:
    """This process's stage: its index, how many there are, and its layers [start_layer, end_layer)."""

    rank: int
    size: int
    start_layer: int
    end_layer: int

    @classmethod
    def of(cls, rank: int, size: int, num_hidden_layers: int) -> "PipelineStage":
        if size > num_hidden_layers:
            raise ValueError(f"pipeline_parallel_size (--pipeline-parallel-size) {size} is more than the "
                             f"model's {num_hidden_layers} layers: every stage needs at least one")
        return cls(rank, size, *get_pp_indices(num_hidden_layers, rank, size))

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.size - 1

    def owns(self, name: str) -> bool:
        """Whether checkpoint tensor `name` (without "model.") is one of this stage's."""
        if name.startswith("layers."):
            return self.start_layer <= int(name.split(".")[1]) < self.end_layer
        if name.startswith("embed_tokens."):
            return self.is_first
        return self.is_last  # norm, lm_head


class PPMissingLayer(nn.Module):
    """The place of a module another stage holds (vLLM's name): no parameters, never called."""

    def forward(self, *args, **kwargs):
        raise RuntimeError("this module lives on another pipeline stage")
