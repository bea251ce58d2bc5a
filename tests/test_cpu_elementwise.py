"""The CPU backend's fused elementwise kernels against the PyTorch ops they replace.

Each kernel must give PyTorch's numbers to fp32 rounding, at prefill and decode sizes, and
for inputs where the exponential under- and overflows; the model must take them on the CPU
backend only, and its hidden states must then be PyTorch's to rounding.
"""

import numba
import numpy as np
import pytest
import torch

from tinyserve.kernels import cpu_elementwise
from tinyserve.models.llama import RMSNorm


@numba.njit
def _exps(x):
    out = np.empty_like(x)
    for i in range(x.size):
        out[i] = cpu_elementwise._exp(x[i])
    return out


def test_the_exponential_is_within_two_roundings_of_the_true_one_over_fp32s_range():
    x = np.linspace(-86.0, 88.7, 1_000_001, dtype=np.float32)
    exact = np.exp(x.astype(np.float64))
    relative = np.abs(_exps(x).astype(np.float64) - exact) / exact
    assert relative.max() < 2.5 * 2.0**-24  # ~1.5e-7: two fp32 roundings
    # Past the range: e^-1000 is (nearly) 0, e^89 and e^1000 overflow as expf's do, so silu(-1000) is -0.
    assert _exps(np.array([-1000.0], np.float32))[0] < 1e-37
    assert np.isinf(_exps(np.array([89.0, 1000.0], np.float32))).all()


def test_silu_and_mul_is_within_three_roundings_of_torchs_for_every_fp32_that_is_a_bf16():
    """Every finite bf16 value as an fp32 gate: the whole range, the tails included."""
    gates = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    gates = gates[torch.isfinite(gates)]
    got = cpu_elementwise.silu_and_mul(torch.stack([gates, torch.ones_like(gates)], dim=1))[:, 0]
    expected = torch.nn.functional.silu(gates)
    normal = expected.abs() > 1e-30
    assert ((got - expected).abs() / expected.abs())[normal].max() < 3 * 2.0**-24  # exp, division, product
    assert (got - expected)[~normal].abs().max() < 1e-40


@pytest.mark.parametrize("rows", [0, 1, 32, 2048])
def test_silu_and_mul_equals_torchs_silu_times_up(rows):
    torch.manual_seed(rows)
    gate_up = torch.randn(rows, 2 * 1376) * 4
    gate_up[:, :8] = torch.tensor([-1000.0, -90.0, -20.0, -0.0, 0.0, 20.0, 90.0, 1000.0])  # silu's tails
    expected = torch.nn.functional.silu(gate_up[:, :1376]) * gate_up[:, 1376:]
    assert cpu_elementwise.fusable(gate_up)
    torch.testing.assert_close(cpu_elementwise.silu_and_mul(gate_up), expected, rtol=3e-7, atol=1e-7)


@pytest.mark.parametrize("rows", [1, 32, 2048])
def test_add_rms_norm_gives_the_sum_exactly_and_its_norm_to_rounding(rows):
    torch.manual_seed(rows)
    x, residual, weight = torch.randn(rows, 512), torch.randn(rows, 512) * 30, torch.rand(512) + 0.5
    normed, total = cpu_elementwise.add_rms_norm(x, residual, weight, 1e-6)
    assert torch.equal(total, x + residual)
    expected = torch.nn.functional.rms_norm(x + residual, (512,), weight, 1e-6)
    torch.testing.assert_close(normed, expected, rtol=1e-6, atol=1e-6)


def test_only_contiguous_fp32_cpu_tensors_are_fusable():
    plain = torch.randn(4, 8)
    assert cpu_elementwise.fusable(plain, plain)
    assert not cpu_elementwise.fusable(plain, plain.bfloat16())
    assert not cpu_elementwise.fusable(plain.t())


def test_a_16_bit_add_and_norm_is_torchs_whether_fused_or_not():
    """bf16 rounds between the add and the norm, as transformers does: the kernel does not take it."""
    norm = RMSNorm(64, 1e-6).bfloat16()
    torch.nn.init.uniform_(norm.weight, 0.5, 1.5)
    x, residual = torch.randn(5, 64).bfloat16(), torch.randn(5, 64).bfloat16()
    for fused in (True, False):
        normed, total = norm.add_and_norm(x, residual, fused)
        assert torch.equal(total, x + residual) and torch.equal(normed, norm(x + residual))


@pytest.mark.parametrize("name", ["llama", "qwen3-tied"])
def test_the_cpu_backends_model_fuses_and_its_logits_are_the_references_to_rounding(name):
    from tests.test_model_parity import CHECKPOINTS, forward_in_steps, load, make_prompts
    from tests.tiny_checkpoints import tiny_checkpoint

    path = tiny_checkpoint(**CHECKPOINTS[name])
    fused, plain = load(path, backend="cpu"), load(path, backend="torch")
    assert fused.fused and all(layer.fused and layer.mlp.fused for layer in fused.layers)
    assert not plain.fused and not any(layer.fused or layer.mlp.fused for layer in plain.layers)
    prompts = make_prompts(fused.vocab_size)
    steps = [[3, 16, 17], [len(p) for p in prompts]]  # a chunk of each prompt, then the rest over the cache
    for got, want in zip(forward_in_steps(fused, prompts, steps), forward_in_steps(plain, prompts, steps)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
