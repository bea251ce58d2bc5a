"""The model's linear layers, and their weights prepared once at load for a CPU.

On a CPU, torch computes a bfloat16 `F.linear` with oneDNN, whose matmul kernels read
the weight in a blocked layout of their own. Handed torch's plain [out_features,
in_features] matrix, oneDNN reorders the whole weight on every call. At
prefill sizes (thousands of rows) that is lost in the matmul; at decode sizes (tens of
rows, one per running request) it is a third of the call or more. Measured with torch
2.13 on the 2-core CPU, bf16, a [512 -> 2752] layer: 154 -> 102 us at 32 rows, 145 -> 67 us
at one row, 2.1 ms either way at 2048.

`pack_linear_weights` reorders each weight once, at load, with the op torch's own
compiler uses when it freezes a model for the CPU (`torch.ops.mkldnn._reorder_linear_weight`);
the layers then call oneDNN's linear on it directly (`torch.ops.mkldnn._linear_pointwise`).
In bf16 the kernels are the same as F.linear's, so the numbers are too, bit for bit
(tests/test_packed_linear.py). The packed weight replaces the plain one (no second copy): a
tensor of torch's `_mkldnn` layout, with the same shape and dtype, that only oneDNN's ops can read.

float32 on an x86 CPU with AVX2 or AVX-512 is packed too. There torch's `F.linear` is MKL's sgemm, which
at decode sizes packs the weight afresh on every call as well: oneDNN over a packed weight
took, at 32 rows, 153 against 217 us for [512 -> 1024], 414 against 588 for [512 -> 2752],
225 against 273 for [1376 -> 512], and the same within 5 % at 2,048 rows (torch 2.13, the
2-core Xeon). oneDNN sums in another order than MKL: results differ by ~1e-6 relative,
so fp32 logits equal transformers' to float rounding, not bit for bit (greedy outputs of
compare.py's workloads: 32 of 32 equal). On an AVX2-only CPU too (a 2-core AMD EPYC, Zen 3),
where MKL is slower still at decode sizes: at 32 rows, 354 against 296 us for [512 -> 1024],
1148 against 828 for [512 -> 2752], and 5.1 against 2.6 ms for an untied [512 -> 8192] LM head;
within -17/+14 % either way at 2,048 rows. compare.py's workload A ran 1.18x as fast packed
(six rounds, two LLMs in one process alternating, 1.11-1.29x), the greedy outputs the same.
Not for float16, whose `F.linear` on a CPU does not always go through oneDNN (some layers'
results changed when packed).

A weight another module shares gets a packed copy of its own: a tied LM head is the input
embedding, which the lookup keeps reading as a plain matrix, and the head multiplies by the
packed copy. The LM head is the largest matmul of a decode step, and left plain it ran on
MKL's sgemm, re-packing its weight on every call: at 32 rows, [512 -> 8192], 3.8 against
2.1 ms (the AMD EPYC). compare.py's workload A in fp32 ran 1.03x as fast (six rounds, two LLMs
in one process alternating, 1.00-1.09x), greedy outputs the same. It costs one more copy of
the embedding matrix (vocab x hidden), as the widened bf16 head below already did.

On a CPU without bf16 matmul instructions (kernels/cpu_bf16.py) there is no oneDNN bf16
kernel to pack for, and torch's portable bf16 matmul is 2.5-6x slower than its fp32 one.
`widen_linear_weights` then keeps each weight in fp32 (the same values, exactly: a bf16
number is an fp32 one), packed as an fp32 model's are, and `linear` widens the input,
multiplies in fp32 and rounds the result back to bf16: the same fp32 products and sums as the emulated bf16 matmul, in
another order (~0.01 % of outputs one bf16 step apart). A tied LM head gets an fp32 copy of
the embedding of its own (the lookup keeps reading the bf16 one). It costs the memory of
an fp32 model's linear weights; it runs at an fp32 model's speed.
"""

import torch
from torch import nn

from tinyserve.kernels.cpu_bf16 import cpu_has_bf16_matmuls


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight^T + bias, whether the weight was widened to fp32, packed, both, or neither."""
    if weight.dtype != x.dtype:  # a bf16 model's weight kept in fp32 (widen_linear_weights)
        return linear(x.to(weight.dtype), weight, bias).to(x.dtype)
    if weight.layout == torch._mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return nn.functional.linear(x, weight, bias)


class Linear(nn.Linear):
    """nn.Linear whose weight may be packed for oneDNN (pack_linear_weights)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


FP32_PACKING_CAPABILITIES = ("AVX2", "AVX512")  # torch's names for the x86 CPUs where packed fp32 was measured faster


def packs_weights(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether pack_linear_weights applies: bf16 on a CPU that oneDNN serves, fp32 on an AVX2 or AVX-512 one.

    bf16 only where torch's own bf16 F.linear goes through oneDNN (a CPU with oneDNN's bf16
    support): elsewhere it computes another way, and packing would change the numbers.
    """
    if (device.type != "cpu" or not torch.backends.mkldnn.is_available()
            or not hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return False
    if dtype == torch.float32:
        return torch.backends.cpu.get_cpu_capability() in FP32_PACKING_CAPABILITIES
    return dtype == torch.bfloat16 and cpu_has_bf16_matmuls()


def pack_linear_weights(model: nn.Module) -> int:
    """Pack the weight of every Linear of the model; returns how many.

    The packed weight is a new tensor either way (oneDNN's layout): a Linear that shared its
    weight with another module (a tied LM head) no longer does, and the other keeps the plain one.
    """
    packed = 0
    for module in model.modules():
        if isinstance(module, Linear) and module.weight.layout == torch.strided:
            weight = torch.ops.mkldnn._reorder_linear_weight(module.weight.detach(), None)
            module.weight = nn.Parameter(weight, requires_grad=False)
            packed += 1
    return packed


def widen_linear_weights(model: nn.Module) -> int:
    """Keep every Linear's weight and bias in fp32, for a CPU without bf16 matmuls; returns how many.

    A weight another module shares (a tied LM head's, the embedding) is copied: the Linear
    gets an fp32 weight of its own and the other module keeps the bf16 one.
    """
    widened = 0
    for module in model.modules():
        if isinstance(module, Linear) and module.weight.dtype == torch.bfloat16:
            module.weight = nn.Parameter(module.weight.detach().float(), requires_grad=False)
            if module.bias is not None:
                module.bias = nn.Parameter(module.bias.detach().float(), requires_grad=False)
            widened += 1
    return widened
