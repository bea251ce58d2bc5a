"""Linear weights packed for oneDNN at load (models/packed_linear.py).

bf16: the same numbers, bit for bit; packing applies only on a CPU whose bf16 matmuls
oneDNN serves (AVX-512 BF16 or AMX). fp32 (and a bf16 model's weights widened to fp32 on
a CPU without bf16 matmuls): packed on an x86 CPU with AVX2 or AVX-512, the same numbers to
float rounding. Both are properties of the processor, which no set-up can install: on
another CPU the tests of the packed numbers skip, in CI too, and the tests of what such a
CPU does instead run.
"""

import pytest
import torch

import tinyserve.kernels.cpu_bf16 as cpu_bf16
import tinyserve.kernels.torch_attention as torch_attention
import tinyserve.models.loader as loader
import tests.test_model_parity as parity
from tinyserve.kernels.metadata import AttentionMetadata
from tinyserve.kernels.torch_attention import TorchAttentionBackend
from tinyserve.models.packed_linear import (
    FP32_PACKING_CAPABILITIES, Linear, linear, pack_linear_weights, packs_weights,
)
from tests.tiny_checkpoints import tiny_checkpoint


ONEDNN_BF16 = packs_weights(torch.device("cpu"), torch.bfloat16)
needs_onednn_bf16 = pytest.mark.skipif(not ONEDNN_BF16, reason="this CPU has no oneDNN bf16 matmuls (AVX-512 BF16 or AMX)")
PACKS_FP32 = torch.backends.cpu.get_cpu_capability() in FP32_PACKING_CAPABILITIES
needs_fp32_packing = pytest.mark.skipif(not PACKS_FP32, reason="this CPU has neither AVX2 nor AVX-512: fp32 weights stay plain")


def load(path, dtype, monkeypatch=None, pack=True):
    if not pack:
        monkeypatch.setattr(loader, "packs_weights", lambda device, dtype: False)
    model, _ = loader.load_model(path, dtype, torch.device("cpu"), TorchAttentionBackend())
    if not pack:
        monkeypatch.undo()
    return model


def prefill_logits(model, num_tokens: int, num_blocks: int = 8) -> torch.Tensor:
    """Logits of every position of one prompt, through the paged cache."""
    config = model.config
    head_dim = model.head_dim
    kv_caches = [torch.zeros(2, num_blocks, 16, model.num_kv_heads, head_dim, dtype=model.embed_tokens.weight.dtype)
                 for _ in range(config.num_hidden_layers)]
    blocks = -(-num_tokens // 16)
    metadata = AttentionMetadata.from_lengths([num_tokens], [num_tokens], torch.arange(blocks, dtype=torch.int32)[None],
                                              torch.arange(num_tokens, dtype=torch.int64))
    input_ids = torch.randint(0, config.vocab_size, (num_tokens,), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        hidden = model(input_ids, torch.arange(num_tokens), kv_caches, metadata)
        return model.compute_logits(hidden)


@needs_onednn_bf16
@pytest.mark.parametrize("tied", [False, True])
def test_packed_bf16_model_computes_the_same_logits_bit_for_bit(monkeypatch, tied):
    dtype = torch.bfloat16
    path = tiny_checkpoint("qwen2", tie_word_embeddings=tied)  # qwen2: biases on q, k, v too
    packed, plain = load(path, dtype), load(path, dtype, monkeypatch, pack=False)
    layers = packed.config.num_hidden_layers
    mkldnn = [name for name, p in packed.named_parameters() if p.layout == torch._mkldnn]
    # qkv, o, gate_up and down of every layer, and the LM head: a tied one as a copy of its own.
    assert len(mkldnn) == 4 * layers + 1 and "lm_head.weight" in mkldnn
    assert all(p.layout == torch.strided for p in plain.parameters())
    assert packed.embed_tokens.weight.layout == torch.strided  # the lookup reads the plain matrix
    # Same shapes and dtypes; nothing else copied.
    shapes = {n: (p.shape, p.dtype) for n, p in packed.named_parameters()}
    assert shapes.pop("lm_head.weight") == (plain.lm_head.weight.shape, plain.lm_head.weight.dtype)
    assert shapes == {n: (p.shape, p.dtype) for n, p in plain.named_parameters() if n != "lm_head.weight"}
    for num_tokens in (1, 7, 40):  # a decode-sized batch and prefill-sized ones
        assert torch.equal(prefill_logits(packed, num_tokens), prefill_logits(plain, num_tokens))


def test_float16_weights_stay_plain_and_float32_ones_are_packed_exactly_on_avx2_and_avx512_cpus():
    model = load(tiny_checkpoint("llama"), torch.float16)
    assert all(p.layout == torch.strided for p in model.parameters())
    assert not packs_weights(torch.device("cpu"), torch.float16)
    model = load(tiny_checkpoint("llama"), torch.float32)
    packed = [name for name, p in model.named_parameters() if p.layout == torch._mkldnn]
    assert len(packed) == (4 * model.config.num_hidden_layers + 1 if PACKS_FP32 else 0)
    assert packs_weights(torch.device("cpu"), torch.float32) == PACKS_FP32
    assert not packs_weights(torch.device("meta"), torch.bfloat16)
    assert not packs_weights(torch.device("meta"), torch.float32)


@needs_fp32_packing
@pytest.mark.parametrize("tied", [False, True])
def test_packed_fp32_model_computes_the_same_logits_to_float_rounding(monkeypatch, tied):
    """oneDNN sums in another order than MKL's sgemm: ~1e-6 relative, and the same greedy tokens."""
    path = tiny_checkpoint("qwen2", tie_word_embeddings=tied)
    packed, plain = load(path, torch.float32), load(path, torch.float32, monkeypatch, pack=False)
    mkldnn = [name for name, p in packed.named_parameters() if p.layout == torch._mkldnn]
    assert len(mkldnn) == 4 * packed.config.num_hidden_layers + 1 and "lm_head.weight" in mkldnn
    assert all(p.layout == torch.strided for p in plain.parameters())
    assert packed.embed_tokens.weight.layout == torch.strided
    for num_tokens in (1, 7, 40):
        got, want = prefill_logits(packed, num_tokens), prefill_logits(plain, num_tokens)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * want.abs().max().item())
        assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_a_bf16_model_is_packed_exactly_where_onednn_serves_bf16_matmuls_and_widened_elsewhere():
    """Where oneDNN has no bf16 kernels of the CPU's own, packing would change numbers; fp32 is faster there."""
    assert ONEDNN_BF16 == (torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    model = load(tiny_checkpoint("llama"), torch.bfloat16)
    packed = [name for name, p in model.named_parameters() if p.layout == torch._mkldnn]
    linears = 4 * model.config.num_hidden_layers + 1
    widens = not cpu_bf16.cpu_has_bf16_matmuls()  # fp32 weights (cpu_bf16.py); tests/cpu_kinds.py may force it off
    widened = [m for m in model.modules() if isinstance(m, Linear) and m.weight.dtype == torch.float32]
    assert len(widened) == (linears if widens else 0)
    assert len(packed) == (linears if (PACKS_FP32 if widens else ONEDNN_BF16) else 0)  # widened: packed as fp32


@needs_fp32_packing
def test_widened_bf16_weights_packed_compute_what_the_plain_widened_ones_do(monkeypatch):
    """A CPU without bf16 matmuls but with AVX2 (forced here on any CPU that packs fp32): fp32
    weights, packed; oneDNN's sums to float rounding, rounded to bf16."""
    monkeypatch.setattr(loader, "computes_bf16_in_fp32", lambda device, dtype: dtype == torch.bfloat16)
    monkeypatch.setattr(torch_attention, "computes_bf16_in_fp32", lambda device, dtype: dtype == torch.bfloat16)
    path = tiny_checkpoint("qwen2", tie_word_embeddings=True)
    packed = load(path, torch.bfloat16)
    monkeypatch.setattr(loader, "packs_weights", lambda device, dtype: False)
    plain = load(path, torch.bfloat16)
    assert packed.lm_head.weight.layout == torch._mkldnn and packed.lm_head.weight.dtype == torch.float32
    assert all(p.layout == torch.strided for p in plain.parameters())
    for num_tokens in (1, 7, 40):
        got, want = prefill_logits(packed, num_tokens), prefill_logits(plain, num_tokens)
        assert got.dtype == want.dtype == torch.float32  # compute_logits: bf16 logits, widened
        assert (got - want).abs().max().item() < 0.02 * want.abs().max().item()  # a bf16 step or two at most
        assert (got.argmax(-1) == want.argmax(-1)).float().mean().item() >= 0.9


@pytest.mark.parametrize("dtype", [
    pytest.param(torch.bfloat16, marks=needs_onednn_bf16),
    pytest.param(torch.float32, marks=needs_fp32_packing),
])
def test_a_shared_weight_is_packed_as_a_copy_and_the_other_module_keeps_the_plain_one(dtype):
    torch.manual_seed(0)
    shared = Linear(64, 32, bias=False).to(dtype)
    own = Linear(64, 32, bias=True).to(dtype)
    embed = torch.nn.Embedding(32, 64).to(dtype)
    model = torch.nn.ModuleDict({"a": shared, "b": own, "embed": embed})
    embed.weight = shared.weight  # tied, as an LM head and the input embedding
    x, ids = torch.randn(3, 64).to(dtype), torch.tensor([3, 0, 2])
    wants, looked_up = (own(x), shared(x)), embed(ids)
    assert pack_linear_weights(model) == 2
    assert own.weight.layout == shared.weight.layout == torch._mkldnn
    assert embed.weight.layout == torch.strided and shared.weight is not embed.weight
    # bf16 packed: bit for bit; fp32: oneDNN's sums against MKL's, to float rounding.
    tolerance = {"rtol": 0, "atol": 0} if dtype == torch.bfloat16 else {"rtol": 1e-5, "atol": 1e-5}
    torch.testing.assert_close(own(x), wants[0], **tolerance)
    torch.testing.assert_close(shared(x), wants[1], **tolerance)
    assert torch.equal(embed(ids), looked_up)
    assert pack_linear_weights(model) == 0  # packing twice is a no-op


def test_linear_over_a_widened_weight_multiplies_in_fp32_and_rounds_back():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(5, 64, generator=generator).bfloat16()
    weight, bias = torch.randn(48, 64, generator=generator).bfloat16(), torch.randn(48, generator=generator).bfloat16()
    got = linear(x, weight.float(), bias.float())
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, torch.nn.functional.linear(x.float(), weight.float(), bias.float()).bfloat16())
    torch.testing.assert_close(got, torch.nn.functional.linear(x, weight, bias), rtol=1.6e-2, atol=1e-2)


@pytest.mark.parametrize("name", ["llama", "qwen3-tied"])
def test_a_bf16_model_on_a_cpu_without_bf16_matmuls_multiplies_in_fp32_and_stays_close_to_transformers(
        monkeypatch, name):
    """Forced here on any CPU: what load_model does where cpu_has_bf16_matmuls() is False."""
    monkeypatch.setattr(loader, "packs_weights", lambda device, dtype: False)
    monkeypatch.setattr(loader, "computes_bf16_in_fp32", lambda device, dtype: dtype == torch.bfloat16)
    monkeypatch.setattr(torch_attention, "computes_bf16_in_fp32", lambda device, dtype: dtype == torch.bfloat16)
    path = tiny_checkpoint(**parity.CHECKPOINTS[name])
    model, _ = loader.load_model(path, torch.bfloat16, torch.device("cpu"), TorchAttentionBackend())
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert linears and all(m.weight.dtype == torch.float32 for m in linears)
    assert all(torch.equal(m.weight.bfloat16().float(), m.weight) for m in linears)  # bf16 values, exactly
    assert model.embed_tokens.weight.dtype == torch.bfloat16  # the lookup still reads bf16
    if model.config.tie_word_embeddings:  # the LM head has an fp32 copy of its own
        assert model.lm_head.weight is not model.embed_tokens.weight
        assert torch.equal(model.lm_head.weight, model.embed_tokens.weight.float())
    prompts = parity.make_prompts(model.vocab_size)
    ours = parity.forward_in_steps(model, prompts, [[len(p) for p in prompts]], dtype=torch.bfloat16)
    got, want = torch.cat(ours), torch.cat(parity.reference_logits(path, prompts, dtype=torch.bfloat16))
    assert (got.argmax(-1) == want.argmax(-1)).float().mean().item() >= 0.9
    assert (got - want).abs().max().item() < 0.05 * want.abs().max().item()
