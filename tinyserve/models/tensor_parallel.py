"""Tensor parallelism inside the model: which slice of each weight a rank holds (Megatron-LM's split).

N ranks run the same layers, each over 1/N of the heads and of the MLP's width; two
all-reduces per layer put the pieces back together:

    x (every rank: all of it)
    ├─ qkv_proj    column-parallel: rank r computes q for its heads, k/v for its KV heads
    ├─ attention   over its own heads only, against its own slice of the KV cache
    ├─ o_proj      row-parallel: rank r multiplies its heads' columns → a partial sum
    │              all_reduce(sum) → every rank holds the whole attention output
    ├─ gate_up     column-parallel: rank r computes its 1/N of the intermediate width
    └─ down_proj   row-parallel → partial sum, all_reduce(sum)

    heads 0..7, N = 2:   rank 0: q heads 0-3, KV heads 0-1    rank 1: q heads 4-7, KV heads 2-3
    KV heads 2, N = 4:   rank r: q heads 2r, 2r+1 and KV head r // 2 (KV heads are replicated
                         when there are fewer than ranks, as vLLM does)

The embedding, the norms and the LM head are replicated: every rank computes the same
logits, so every rank's sampler draws the same tokens from the same seeds and keeps the
same request state, with no second collective per step (vLLM's choice too). A
vocab-parallel LM head would save memory on a large vocabulary at the cost of an
all-gather of the logits each step; at tinyserve's model sizes the memory is small.

The collective is torch.distributed's all_reduce (gloo on CPU, NCCL on CUDA): it does the
communication, its algorithms (ring, tree) and its transport for us.
"""

from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from tinyserve.models.packed_linear import Linear, linear


@dataclass
class TensorParallel:
    """This rank's place in the group and the collective its row-parallel layers call."""

    rank: int
    size: int
    all_reduce: Callable[[torch.Tensor], torch.Tensor] = field(repr=False)
    timer: object = field(default=None, repr=False)  # what times all_reduce, if anything (.seconds)


@dataclass(frozen=True)
class HeadSplit:
    """The attention heads one rank holds, out of the model's."""

    num_heads: int  # query heads on this rank
    num_kv_heads: int  # KV heads on this rank (1 when replicated)
    first_head: int  # global index of its first query head
    first_kv_head: int  # global index of its first KV head


def split_heads(num_heads: int, num_kv_heads: int, tp_size: int, rank: int) -> HeadSplit:
    """Which heads rank `rank` of `tp_size` holds; ValueError naming the numbers if they do not split."""
    if num_heads % tp_size:
        raise ValueError(f"num_attention_heads ({num_heads}) must be divisible by tensor_parallel_size ({tp_size})")
    local_heads = num_heads // tp_size
    if num_kv_heads >= tp_size:
        if num_kv_heads % tp_size:
            raise ValueError(f"num_key_value_heads ({num_kv_heads}) must be divisible by tensor_parallel_size "
                             f"({tp_size}), or divide it")
        local_kv = num_kv_heads // tp_size
        return HeadSplit(local_heads, local_kv, rank * local_heads, rank * local_kv)
    if tp_size % num_kv_heads:
        raise ValueError(f"tensor_parallel_size ({tp_size}) must be a multiple of num_key_value_heads "
                         f"({num_kv_heads}) when it is larger")
    group = num_heads // num_kv_heads  # query heads per KV head
    return HeadSplit(local_heads, 1, rank * local_heads, rank * local_heads // group)


def split_width(width: int, tp_size: int, what: str) -> int:
    if width % tp_size:
        raise ValueError(f"{what} ({width}) must be divisible by tensor_parallel_size ({tp_size})")
    return width // tp_size


class RowParallelLinear(Linear):
    """y = all_reduce(x_r @ W_r^T) + b: this rank holds the input columns of its shard.

    With one rank (tp None) it is a plain Linear. The bias is added once, after the sum.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TensorParallel | None):
        super().__init__(in_features, out_features, bias=bias)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp is None:
            return super().forward(x)
        out = self.tp.all_reduce(linear(x, self.weight))
        return out if self.bias is None else out + self.bias


def checkpoint_slice(name: str, tensor: torch.Tensor, config, tp: TensorParallel) -> torch.Tensor:
    """The part of checkpoint tensor `name` (without "model.") that rank tp.rank holds."""
    if ".self_attn." not in name and ".mlp." not in name:
        return tensor  # embeddings, norms, LM head: replicated
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    split = split_heads(config.num_attention_heads, config.num_key_value_heads, tp.size, tp.rank)
    if ".q_proj." in name:
        return tensor.narrow(0, split.first_head * head_dim, split.num_heads * head_dim)
    if ".k_proj." in name or ".v_proj." in name:
        return tensor.narrow(0, split.first_kv_head * head_dim, split.num_kv_heads * head_dim)
    if ".o_proj.weight" in name:
        return tensor.narrow(1, split.first_head * head_dim, split.num_heads * head_dim)
    width = split_width(config.intermediate_size, tp.size, "intermediate_size")
    if ".gate_proj." in name or ".up_proj." in name:
        return tensor.narrow(0, tp.rank * width, width)
    if ".down_proj.weight" in name:
        return tensor.narrow(1, tp.rank * width, width)
    return tensor  # o_proj / down_proj bias: added once after the all-reduce, whole on every rank
