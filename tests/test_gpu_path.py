"""The GPU path's logic, checked where there is no GPU.

- Decode steps through the static buffers of the CUDA graphs (engine/worker/cuda_graphs.py):
  on a CPU the same buffers run eagerly through the Triton kernels (interpreter), so the
  padding to batch-size buckets is tested here; only the recording itself needs CUDA.
- The KV cache's size under --gpu-memory-utilization: the arithmetic, with its errors, and
  the dummy step it is measured on (on a CPU; the measuring itself needs CUDA).
- The model is built in its serving dtype: no fp32 copy of a weight, ever.
- The flags.
"""

import argparse
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch.utils._python_dispatch import TorchDispatchMode

from tests.hf_reference import hf_greedy
from tests.tiny_checkpoints import tiny_model_with_tokenizer
from tinyserve import LLM, SamplingParams
from tinyserve.cli.engine_flags import add_engine_flags, engine_args_from
from tinyserve.config import EngineArgs
from tinyserve.engine.worker import sampler as sampler_module
from tinyserve.engine.worker.cuda_graphs import DecodeGraphs, batch_size_buckets
from tinyserve.engine.worker.gpu_memory import GiB, dummy_step, kv_cache_bytes, scratch_kv_caches
from tinyserve.kernels.metadata import AttentionMetadata
from tinyserve.kernels.torch_attention import TorchAttentionBackend
from tinyserve.kernels.triton_backend import TritonAttentionBackend
from tinyserve.models import loader
from tinyserve.models.loader import load_model


def test_buckets_are_1_2_4_then_multiples_of_8_up_to_the_seat_count():
    assert batch_size_buckets(256) == [1, 2, 4] + list(range(8, 257, 8))
    assert batch_size_buckets(20) == [1, 2, 4, 8, 16, 20]
    assert batch_size_buckets(3) == [1, 2, 3]
    assert batch_size_buckets(1) == [1]


def decode_batch(seq_lens: list[int], block_size: int, first_block: int = 1):
    """Metadata of one decode step: sequence i owns consecutive blocks, its new token at seq_lens[i] - 1."""
    tables, slots, next_block = [], [], first_block
    for n in seq_lens:
        count = -(-n // block_size)
        tables.append(list(range(next_block, next_block + count)))
        slots.append(tables[-1][(n - 1) // block_size] * block_size + (n - 1) % block_size)
        next_block += count
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    metadata = AttentionMetadata.from_lengths([1] * len(seq_lens), seq_lens, block_tables, torch.tensor(slots))
    return metadata, next_block


@pytest.mark.interpreter
@pytest.mark.parametrize("num_seqs", [1, 3, 5])
def test_a_padded_bucket_gives_the_eager_forward_and_writes_only_real_slots(num_seqs):
    model, _ = load_model(tiny_model_with_tokenizer("llama"), torch.float32, torch.device("cpu"),
                          TritonAttentionBackend("cpu", max_model_len=2048))
    block_size = 16
    seq_lens = [5, 33, 17, 48, 2][:num_seqs]
    metadata, num_blocks = decode_batch(seq_lens, block_size)
    generator = torch.Generator().manual_seed(num_seqs)
    # Every block holds some earlier context (finite values), as a used pool does.
    shape = (2, num_blocks, block_size, model.num_kv_heads, model.head_dim)
    caches = [torch.randn(shape, generator=generator) for _ in range(model.num_layers)]
    before = [cache.clone() for cache in caches]
    eager_caches = [cache.clone() for cache in caches]
    input_ids = torch.randint(0, model.vocab_size, (num_seqs,), generator=generator)
    positions = torch.tensor([n - 1 for n in seq_lens])

    graphs = DecodeGraphs(model, caches, max_num_seqs=8, max_model_len=64, block_size=block_size,
                          device=torch.device("cpu"), capture=False)
    bucket = graphs.bucket_for(num_seqs)
    assert bucket == {1: 1, 3: 4, 5: 8}[num_seqs]
    hidden = graphs.run(input_ids, positions, metadata)
    with torch.inference_mode():
        wants = model(input_ids, positions, eager_caches, metadata)

    assert hidden.shape == wants.shape
    torch.testing.assert_close(hidden, wants, rtol=1e-5, atol=1e-5)
    # The real rows wrote their slots as the eager step did (a padded matmul may round the
    # last bit differently); the padding rows (slot -1) wrote nothing anywhere else.
    real = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    real[metadata.slot_mapping] = True
    for cache, eager, old in zip(caches, eager_caches, before):
        slots, eager_slots, old_slots = (c.view(2, -1, model.num_kv_heads, model.head_dim) for c in (cache, eager, old))
        torch.testing.assert_close(slots[:, real], eager_slots[:, real], rtol=1e-5, atol=1e-5)
        assert torch.equal(slots[:, ~real], old_slots[:, ~real])


def test_graphs_refuse_a_batch_they_have_no_bucket_for():
    model, _ = load_model(tiny_model_with_tokenizer("llama"), torch.float32, torch.device("cpu"),
                          TritonAttentionBackend("cpu", max_model_len=2048))
    metadata, num_blocks = decode_batch([3] * 5, 16)
    caches = [torch.zeros(2, num_blocks, 16, model.num_kv_heads, model.head_dim) for _ in range(model.num_layers)]
    graphs = DecodeGraphs(model, caches, max_num_seqs=4, max_model_len=64, block_size=16,
                          device=torch.device("cpu"), capture=False)
    assert graphs.bucket_for(5) is None
    with pytest.raises(ValueError, match="decode-only batches of at most 4 sequences"):
        graphs.run(torch.zeros(5, dtype=torch.int64), torch.full((5,), 2), metadata)


PROMPTS = [[5, 9, 33, 71, 120], list(range(40, 75)), [200, 3, 17]]


@pytest.mark.interpreter
def test_engine_decodes_through_the_graph_buffers_unless_enforce_eager():
    folder = tiny_model_with_tokenizer("llama")
    # Different lengths: the batch shrinks 3 -> 2 -> 1 as requests finish (buckets 4, 2, 1).
    params = [SamplingParams(temperature=0.0, max_tokens=n) for n in (12, 7, 3)]
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    expected = [hf_greedy(folder, p)[:n] for p, n in zip(PROMPTS, (12, 7, 3))]

    graphs = LLM(str(folder), attention_backend="triton", num_kv_blocks=32, max_num_seqs=6)
    eager = LLM(str(folder), attention_backend="triton", num_kv_blocks=32, max_num_seqs=6, enforce_eager=True)
    with_graphs = [o.outputs[0].token_ids for o in graphs.generate(prompts, params, use_tqdm=False)]
    without = [o.outputs[0].token_ids for o in eager.generate(prompts, params, use_tqdm=False)]

    assert with_graphs == without == expected
    assert graphs.engine_core.model_runner.num_graph_steps >= 10
    assert eager.engine_core.model_runner.decode_graphs is None
    # The torch backend reads host-side lengths (its decode groups), so it never uses the buffers.
    assert LLM(str(folder), num_kv_blocks=8).engine_core.model_runner.decode_graphs is None


class CreatedTensors(TorchDispatchMode):
    """Every tensor any operation makes while active: (dtype, shape)."""

    def __init__(self):
        super().__init__()
        self.created = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.created += [(t.dtype, tuple(t.shape)) for t in torch.utils._pytree.tree_leaves(out)
                         if isinstance(t, torch.Tensor)]
        return out


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_a_bf16_model_is_built_in_bf16_with_no_fp32_copy_of_any_weight(family, tmp_path, monkeypatch):
    # A 40B model built in fp32 first would need 149 GiB for a moment. The checkpoint is
    # saved in bf16 here, as real ones are: an fp32 one is read in fp32, a tensor at a time.
    # Built on the CPU as a GPU would build it: a CPU without bf16 matmuls would widen the
    # linear weights to fp32 after loading, its own way to compute (test_packed_linear.py).
    monkeypatch.setattr(loader, "computes_bf16_in_fp32", lambda device, dtype: False)
    folder = tmp_path / family
    shutil.copytree(tiny_model_with_tokenizer(family), folder)
    weights = {name: tensor.to(torch.bfloat16) for name, tensor in load_file(folder / "model.safetensors").items()}
    save_file(weights, folder / "model.safetensors")
    with CreatedTensors() as mode:
        model, _ = load_model(folder, torch.bfloat16, torch.device("cpu"), TorchAttentionBackend())
    weight_shapes = {tuple(param.shape) for param in model.parameters()}
    assert {param.dtype for param in model.parameters()} == {torch.bfloat16}
    assert [created for created in mode.created if created[0] == torch.float32 and created[1] in weight_shapes] == []
    assert torch.get_default_dtype() == torch.float32  # restored


# ---- --gpu-memory-utilization ---------------------------------------------------------------------


def test_the_kv_cache_gets_what_weights_activations_graphs_and_cuda_leave_of_the_share():
    budget = kv_cache_bytes(total=80 * GiB, free_at_start=79 * GiB, utilization=0.9, weights=16 * GiB,
                            peak_activations=3 * GiB, non_torch=GiB // 2, cuda_graphs=GiB // 4)
    assert budget == int(80 * GiB * 0.9) - 16 * GiB - 3 * GiB - GiB // 2 - GiB // 4


def test_the_profiles_dummy_step_samples_a_full_batch_the_costliest_way_and_every_prompt_logprob(monkeypatch):
    # What the KV cache must leave room for: top-k/top-p over max_num_seqs rows (sort, cumsum,
    # scatter of the whole vocabulary) and prompt logprobs over every token of the step.
    model, _ = load_model(tiny_model_with_tokenizer("llama"), torch.float32, torch.device("cpu"),
                          TorchAttentionBackend())
    filtered = []
    original = sampler_module.apply_top_k_top_p
    monkeypatch.setattr(sampler_module, "apply_top_k_top_p",
                        lambda logits, params: filtered.append(logits.shape) or original(logits, params))
    caches = scratch_kv_caches(model, num_blocks=3 * 2, block_size=16, dtype=torch.float32, device=torch.device("cpu"))
    sampled, prompt_rows = dummy_step(model, caches, num_tokens=80, max_num_seqs=6, max_model_len=32, block_size=16,
                                      device=torch.device("cpu"))
    assert (sampled, prompt_rows) == (6, 80)
    assert filtered == [(6, model.vocab_size)]
    assert all(cache.abs().sum() > 0 for cache in caches)  # every layer wrote its K/V: the forward ran


def test_a_gpu_too_busy_for_the_share_is_refused_with_the_numbers():
    with pytest.raises(ValueError, match=r"asks for 72\.00 GiB .* only 40\.00 GiB were free"):
        kv_cache_bytes(total=80 * GiB, free_at_start=40 * GiB, utilization=0.9, weights=GiB,
                       peak_activations=GiB, non_torch=0)


def test_weights_larger_than_the_share_leave_no_kv_cache_and_say_so():
    with pytest.raises(ValueError, match=r"no memory left for the KV cache: .* the weights take 15\.00 GiB"):
        kv_cache_bytes(total=16 * GiB, free_at_start=16 * GiB, utilization=0.5, weights=15 * GiB,
                       peak_activations=GiB, non_torch=0)


@pytest.mark.parametrize("utilization", [0.0, -0.1, 1.5])
def test_gpu_memory_utilization_outside_0_1_is_rejected(utilization):
    with pytest.raises(ValueError, match=f"gpu_memory_utilization must be in \\(0, 1\\], got {utilization}"):
        EngineArgs.from_kwargs(gpu_memory_utilization=utilization)


def test_the_gpu_flags_reach_the_engine_args():
    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    args = engine_args_from(parser.parse_args(["--gpu-memory-utilization", "0.5", "--enforce-eager"]))
    assert (args.gpu_memory_utilization, args.enforce_eager) == (0.5, True)
    defaults = engine_args_from(parser.parse_args([]))
    assert (defaults.gpu_memory_utilization, defaults.enforce_eager) == (0.9, False)
    with pytest.raises(ValueError, match="gpu_memory_utilization must be in"):
        engine_args_from(parser.parse_args(["--gpu-memory-utilization", "2"]))
