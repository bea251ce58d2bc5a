"""Whether this CPU multiplies bfloat16 matrices itself, or torch emulates it.

A CPU with AVX-512 BF16 or AMX (recent Xeons, AMD Zen 4 and later) has instructions that
multiply bf16 numbers and add the products into fp32 sums; oneDNN uses them, and a bf16
matmul is then about twice as fast as an fp32 one. A CPU without them (AVX2-only: AMD Zen 3
and older, most laptops' Intel cores) has torch compute a bf16 matmul in portable code that
widens each number to fp32 on the fly: the same fp32 sums, but 2.5-6x *slower* than fp32.
Measured with torch 2.13 on a 2-core AMD EPYC (Zen 3), a [512 -> 2752] layer: 6.5 ms at 32
rows in bf16 against 2.6 ms in fp32; 205 ms against 32 ms at 1,024 rows; attention over
32 sequences of 288 tokens, 7.5 ms against 4.4.

On such a CPU a bf16 model computes its matmuls in fp32 instead (`models/packed_linear.py`,
`kernels/torch_attention.py`): every bf16 number is exactly an fp32 one, so the inputs are
the same, the products and sums are fp32 either way, and the result is rounded back to
bf16. What can differ is only the order of the sums, which moves ~0.01 % of the outputs by
one bf16 step; outputs agree with transformers' bf16 as closely as bf16 runs agree anywhere.
"""

import functools

import torch


@functools.cache
def cpu_has_bf16_matmuls() -> bool:
    """True where oneDNN has bf16 matmul instructions on this CPU (AVX-512 BF16, AMX, or Arm's BF16)."""
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def computes_bf16_in_fp32(device: torch.device, dtype: torch.dtype) -> bool:
    """A bf16 model on a CPU that would emulate bf16 matmuls: it multiplies in fp32 instead."""
    return device.type == "cpu" and dtype == torch.bfloat16 and not cpu_has_bf16_matmuls()
