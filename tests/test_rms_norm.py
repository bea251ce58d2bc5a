"""RMSNorm equals transformers' own, bit for bit, in float32 (one fused op) and in 16 bits (two)."""

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from tinyserve.models.llama import RMSNorm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 64), (7, 64), (32, 512), (2048, 512), (5, 3, 24)])
def test_rms_norm_equals_transformers_bit_for_bit(dtype, shape):
    generator = torch.Generator().manual_seed(len(shape) * 1000 + shape[-1])
    weight = torch.randn(shape[-1], generator=generator) * 0.5 + 1
    x = (torch.randn(shape, generator=generator) * 3).to(dtype)
    ours, theirs = RMSNorm(shape[-1], 1e-6).to(dtype), LlamaRMSNorm(shape[-1], eps=1e-6).to(dtype)
    with torch.no_grad():
        ours.weight.copy_(weight)
        theirs.weight.copy_(weight)
        assert torch.equal(ours(x), theirs(x))
