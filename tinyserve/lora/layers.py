"""LoRALinear: a model's Linear plus the low-rank products of the adapters in the batch.

One forward pass serves requests of different adapters and of the base model together,
as Punica and S-LoRA do: the batch's tokens are grouped by the adapter slot their request
uses (`LoRABatch.groups`, set by the manager before each forward pass), and each group's
rows get their adapter's delta on top of the base model's output:

    out = base(x)                                         every token, one matmul
    for slot, rows in groups:                             one group per adapter in the batch
        for each sub-projection i the adapter targets:    q/k/v of qkv_proj, gate/up of gate_up_proj
            out[rows, cols_i] += B_i(A_i(x[rows])) * scaling

That is a segmented (SGMV-style) batched product: a GPU kernel would do the groups in one
launch; on a CPU each group is two small matmuls over exactly its rows, and the base
model's tokens cost nothing more than the base model. The packed projections of the
model (q, k, v stacked in qkv_proj, gate and up in gate_up_proj) take each adapter
projection's delta into their own column slice, which is exactly PEFT's
`q_proj(x) + lora_B(lora_A(x)) * scaling` for each of them: the same products, the same
single addition, so fp32 outputs equal PEFT's.
"""

from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass(slots=True)
class LoRABatch:
    """This forward pass's adapter groups: (slot, the flat token rows that use it; None = every row)."""

    groups: list[tuple[int, torch.Tensor | None]] = field(default_factory=list)


class LoRALinear(nn.Module):
    """`base` (a Linear, possibly packed) with up to max_loras adapters resident, one per slot.

    slices: the (start, size) output columns of each sub-projection: three for qkv_proj,
    two for gate_up_proj, one for o_proj and down_proj. A slot holds, for each of them,
    (A [r, in], B [size, r]) or None where its adapter leaves that projection alone.
    """

    def __init__(self, base: nn.Module, slices: list[tuple[int, int]], batch: LoRABatch, max_loras: int):
        super().__init__()
        self.base = base
        self.slices = slices
        self.batch = batch
        self.slots: list[list[tuple[torch.Tensor, torch.Tensor] | None] | None] = [None] * max_loras
        self.scalings = [0.0] * max_loras

    def set_slot(self, slot: int, weights: list[tuple[torch.Tensor, torch.Tensor] | None], scaling: float) -> None:
        self.slots[slot] = weights if any(w is not None for w in weights) else None
        self.scalings[slot] = scaling

    def clear_slot(self, slot: int) -> None:
        self.slots[slot] = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        for slot, rows in self.batch.groups:
            weights = self.slots[slot]
            if weights is None:
                continue
            xs = x if rows is None else x.index_select(0, rows)
            scaling = self.scalings[slot]
            for (start, size), ab in zip(self.slices, weights):
                if ab is None:
                    continue
                delta = nn.functional.linear(nn.functional.linear(xs, ab[0]), ab[1]) * scaling
                columns = out.narrow(1, start, size)
                if rows is None:
                    columns += delta
                else:
                    columns.index_add_(0, rows, delta)
        return out


# The model's Linear modules an adapter may add to: (its path in a decoder layer, the size
# attribute of its sub-projections' owner, the PEFT names of its sub-projections in order).
WRAPPED = (
    ("self_attn", "qkv_proj", "qkv_sizes", ("q_proj", "k_proj", "v_proj")),
    ("self_attn", "o_proj", None, ("o_proj",)),
    ("mlp", "gate_up_proj", "gate_up_sizes", ("gate_proj", "up_proj")),
    ("mlp", "down_proj", None, ("down_proj",)),
)


def wrap_model(model: nn.Module, batch: LoRABatch, max_loras: int) -> dict[tuple[int, str], tuple[LoRALinear, int]]:
    """Replace each adaptable Linear of every decoder layer with a LoRALinear around it.

    Returns, for each (layer, PEFT module name), the LoRALinear that computes it and the
    index of its sub-projection there. The base weights are untouched (and stay packed).
    """
    targets = {}
    for layer_index, layer in enumerate(model.layers):
        for parent_name, name, sizes_attribute, peft_names in WRAPPED:
            parent = getattr(layer, parent_name)
            base = getattr(parent, name)
            sizes = getattr(parent, sizes_attribute) if sizes_attribute else [base.out_features]
            starts = [sum(sizes[:i]) for i in range(len(sizes))]
            wrapped = LoRALinear(base, list(zip(starts, sizes)), batch, max_loras)
            setattr(parent, name, wrapped)
            for index, peft_name in enumerate(peft_names):
                targets[(layer_index, peft_name)] = (wrapped, index)
    return targets
