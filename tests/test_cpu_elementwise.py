"""The CPU backend's fused elementwise kernels against the PyTorch ops they replace.

Each kernel must give PyTorch's numbers to fp32 rounding, at prefill and decode sizes, and
for inputs where the exponential under- and overflows; the model must take them on the CPU
backend only, and its hidden states must then be PyTorch's to rounding.
"""

import numba
import numpy as np
import pytest
import torch
from transformers import LlamaConfig

from tinyserve.kernels import cpu_elementwise
from tinyserve.kernels.backend import get_attention_backend
from tinyserve.models.llama import LlamaForCausalLM, RMSNorm
from tinyserve.models.rope import RotaryEmbedding


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


def test_only_contiguous_cpu_tensors_all_fp32_or_all_bf16_are_fusable():
    plain = torch.randn(4, 8)
    assert cpu_elementwise.fusable(plain, plain)
    assert cpu_elementwise.fusable(plain.bfloat16(), plain.bfloat16())
    assert not cpu_elementwise.fusable(plain, plain.bfloat16())
    assert not cpu_elementwise.fusable(plain.half())
    assert not cpu_elementwise.fusable(plain.t())


def bf16_steps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many bf16 steps apart each pair is (same sign: the difference of their bit patterns)."""
    return (a.view(torch.int16).int() - b.view(torch.int16).int()).abs()


def test_bf16_silu_and_mul_gives_transformers_bits_for_every_bf16_gate():
    """silu(gate) rounded to bf16, then the product rounded: torch's bits for every finite bf16 gate."""
    gates = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    gates = gates[torch.isfinite(gates.float())]
    for up in (1.0, 3.0, -0.7):
        ups = torch.full_like(gates, up)
        got = cpu_elementwise.silu_and_mul(torch.stack([gates, ups], dim=1))[:, 0]
        expected = torch.nn.functional.silu(gates) * ups
        assert got.dtype == torch.bfloat16
        assert torch.equal(got, expected), int((got != expected).sum())


def test_bf16_kernels_carry_a_nan_and_infinities_as_torch_does():
    special = torch.tensor([float("nan"), float("inf"), -float("inf"), 1.0]).bfloat16()
    gate_up = torch.stack([special, torch.full_like(special, 2.0)], dim=1)
    got = cpu_elementwise.silu_and_mul(gate_up)[:, 0]
    expected = torch.nn.functional.silu(special) * 2.0
    assert torch.equal(got.view(torch.int16), expected.view(torch.int16))  # NaN's bits too
    x = torch.tensor([[float("nan"), 1.0], [3.0, 4.0]]).bfloat16()
    normed, total = cpu_elementwise.add_rms_norm(x, torch.zeros_like(x), torch.ones(2).bfloat16(), 1e-6)
    assert torch.isnan(total[0, 0]) and torch.isnan(normed[0]).all()  # a NaN row stays NaN
    assert torch.equal(normed[1], RMSNorm(2, 1e-6).bfloat16()(x[1:])[0])


@pytest.mark.parametrize("rows", [1, 32, 2048])
def test_bf16_silu_and_mul_equals_torchs_at_model_sizes(rows):
    torch.manual_seed(rows)
    gate_up = (torch.randn(rows, 2 * 1376) * 3).bfloat16()
    gate, up = gate_up.chunk(2, dim=-1)
    assert torch.equal(cpu_elementwise.silu_and_mul(gate_up), torch.nn.functional.silu(gate) * up)


@pytest.mark.parametrize("rows", [1, 32, 2048])
def test_bf16_add_and_norm_rounds_where_transformers_does(rows):
    """The sum is torch's exactly; the norm is, but for the rare element whose fp32 value sits at a
    bf16 halfway point within the rounding of the sum of squares (added in another order): one or
    two bf16 steps there (the normalized value's step, then the weight's product's)."""
    torch.manual_seed(rows)
    norm = RMSNorm(512, 1e-6).bfloat16()
    torch.nn.init.uniform_(norm.weight, 0.5, 1.5)
    x, residual = torch.randn(rows, 512).bfloat16(), (torch.randn(rows, 512) * 30).bfloat16()
    assert cpu_elementwise.fusable(x, residual, norm.weight)
    fused_normed, fused_total = norm.add_and_norm(x, residual, fused=True)
    normed, total = norm.add_and_norm(x, residual, fused=False)
    assert torch.equal(fused_total, x + residual) and torch.equal(total, x + residual)
    steps = bf16_steps(fused_normed, normed)
    assert steps.max() <= 2
    assert (steps > 0).float().mean() < 1e-3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 32, 2048])
def test_rotate_gives_ropes_bits_for_the_heads_at_the_front_of_each_row(rows, dtype):
    """q and k at the front of each row of a qkv projection, v after them: RotaryEmbedding.rotate's
    bits, in fp32 (each product rounded before the sum) and in bf16 (each of torch's ops rounded)."""
    torch.manual_seed(rows)
    rope = RotaryEmbedding(64, 4096, {"rope_type": "default", "rope_theta": 10000.0})
    cos_sin = rope.lookup(torch.randint(0, 4096, (rows,)), dtype)
    qkv = (torch.randn(rows, 16 * 64) * 3).to(dtype)
    qkv[0, :4] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0])
    assert cpu_elementwise.fusable(qkv, *cos_sin)
    got = cpu_elementwise.rotate(cos_sin, qkv, 12, 64)
    expected = RotaryEmbedding.rotate(cos_sin, qkv[:, :12 * 64].view(rows, 12, 64))
    assert got.shape == (rows, 12, 64) and got.dtype == dtype
    assert torch.equal(got.nan_to_num(), expected.nan_to_num())
    assert torch.equal(got.isnan(), expected.isnan())


@pytest.mark.parametrize("backend, kernel_calls", [("cpu", 1), ("torch", 0)])
def test_the_model_rotates_with_the_kernel_on_the_cpu_backend_only(backend, kernel_calls, monkeypatch):
    calls = []
    real = cpu_elementwise.rotate
    monkeypatch.setattr(cpu_elementwise, "rotate", lambda *args: calls.append(args) or real(*args))
    config = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    model = LlamaForCausalLM(config, get_attention_backend(backend, torch.device("cpu"), 64))
    attention = model.layers[0].self_attn
    cos_sin = model.rotary_emb.lookup(torch.arange(3), torch.float32)
    qkv = torch.randn(3, 8 * 16)
    calls.clear()  # the CPU backend warms its kernels up when it is made
    rotated = attention._rotate(cos_sin, qkv, 6)
    assert torch.equal(rotated, RotaryEmbedding.rotate(cos_sin, qkv[:, :6 * 16].view(3, 6, 16)))
    assert len(calls) == kernel_calls
