"""--kv-cache-dtype: keys and values stored in a dtype of their own, and read back as the model's.

The specification: an engine whose cache is bfloat16, float16 or fp8 under a float32
model generates exactly what transformers generates when its own cache rounds every
key and value to that dtype the same way (RoundingCache in tests/hf_reference.py):
greedy, token for token. How far that drifts from the float32 cache is the dtype's business, and is
reported (printed here, measured in BENCHMARKS.md), not asserted.
"""

import argparse

import pytest
import torch

from tests.hf_reference import MAX_TOKENS, hf_greedy, hf_model
from tests.paged_batches import make_paged_batch
from tests.tiny_checkpoints import tiny_model_with_tokenizer
from tinyserve import LLM, SamplingParams
from tinyserve.cli.engine_flags import add_engine_flags
from tinyserve.config import KV_CACHE_DTYPES, EngineArgs
from tinyserve.engine.worker.model_runner import ModelRunner
from tinyserve.kernels.torch_attention import TorchAttentionBackend

NARROW = ["bfloat16", "float16", "fp8", "fp8_e5m2"]
PROMPT_LENGTHS = (5, 17, 40, 70)


@pytest.fixture(scope="module")
def folder_and_prompts():
    folder = tiny_model_with_tokenizer("llama")
    generator = torch.Generator().manual_seed(1234)
    vocab_size = hf_model(folder).config.vocab_size
    return folder, [torch.randint(3, vocab_size, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]


@pytest.mark.parametrize("name", NARROW)
def test_greedy_equals_transformers_with_its_cache_rounded_to_the_same_dtype(folder_and_prompts, name):
    folder, prompts = folder_and_prompts
    expected = [hf_greedy(folder, p, KV_CACHE_DTYPES[name]) for p in prompts]
    llm = LLM(str(folder), kv_cache_dtype=name)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                        use_tqdm=False)]
    assert got == expected
    assert all(cache.dtype == KV_CACHE_DTYPES[name] for cache in llm.engine_core.model_runner.kv_caches)
    fp32 = [hf_greedy(folder, p) for p in prompts]
    same = sum(a == b for want, have in zip(fp32, got) for a, b in zip(want, have))
    print(f"{name}: {same} of {sum(map(len, fp32))} tokens as with a float32 cache (random weights)")


def test_auto_is_the_models_dtype_and_a_narrower_cache_holds_more_blocks_in_the_same_memory():
    folder = tiny_model_with_tokenizer("llama")
    blocks = {}
    for name in ("auto", "bfloat16", "fp8"):
        llm = LLM(str(folder), kv_cache_dtype=name, kv_cache_memory=1 << 20)
        runner = llm.engine_core.model_runner
        blocks[name] = llm.engine_core.num_kv_blocks
        assert runner.kv_caches[0].dtype == (torch.float32 if name == "auto" else KV_CACHE_DTYPES[name])
        assert llm.model_info.kv_cache_dtype == runner.kv_caches[0].dtype
        per_block = ModelRunner.kv_bytes_per_block(runner.model, 16, runner.kv_caches[0].dtype)
        assert blocks[name] == (1 << 20) // per_block
    assert 2 * blocks["auto"] <= blocks["bfloat16"] <= 2 * blocks["auto"] + 1  # the same bytes, floored
    assert 4 * blocks["auto"] <= blocks["fp8"] <= 4 * blocks["auto"] + 3


@pytest.mark.parametrize("name", NARROW)
def test_the_torch_backend_reads_a_narrow_cache_as_the_float32_cache_of_its_rounded_values(name):
    dtype = KV_CACHE_DTYPES[name]
    # A prefill chunk after a cached prefix, a fresh prompt, and decodes: both attention paths.
    batch = make_paged_batch([40, 13, 30, 17, 9], [11, 13, 1, 1, 1], seed=3, head_dim=24)
    batch.kv_cache.nan_to_num_(0.0)  # this backend's decode batch reads the padding slots (with weight 0)
    narrow = batch.kv_cache.to(dtype)
    backend = TorchAttentionBackend()
    out = backend.attention(batch.query, narrow, batch.metadata, batch.scale)
    assert out.dtype == torch.float32
    assert torch.equal(out, backend.attention(batch.query, narrow.float(), batch.metadata, batch.scale))

    key, value = torch.randn(2, batch.query.shape[0], 2, 24, generator=torch.Generator().manual_seed(4)) * 1000
    backend.write_kv(key, value, narrow, batch.metadata)
    slots = narrow.view(2, -1, 2, 24)[:, batch.metadata.slot_mapping]
    assert torch.equal(slots[0], key.to(dtype)) and torch.equal(slots[1], value.to(dtype))
    if dtype == torch.float8_e4m3fn:  # out of range saturates at E4M3's largest finite value, never NaN
        assert slots[0].float().abs().max() == 448


@pytest.mark.interpreter
@pytest.mark.parametrize("name", ["bfloat16", "fp8"])
def test_the_triton_kernels_read_a_narrow_cache_under_a_float32_query_as_the_torch_backend_does(name):
    from tinyserve.kernels.triton_backend import TritonAttentionBackend

    dtype = KV_CACHE_DTYPES[name]
    triton, torch_backend = TritonAttentionBackend("cpu", 512), TorchAttentionBackend()
    for query_lens in ([1, 1, 1], [11, 13, 1]):  # the decode kernel, then the prefill kernel
        batch = make_paged_batch([40, 13, 30], query_lens, seed=5, head_dim=32)
        narrow = batch.kv_cache.nan_to_num(0.0).to(dtype)
        out = triton.attention(batch.query, narrow, batch.metadata, batch.scale)
        expected = torch_backend.attention(batch.query, narrow, batch.metadata, batch.scale)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_an_unknown_kv_cache_dtype_is_refused_naming_the_choices(capsys):
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of .*fp8_e5m2.*got 'int8'"):
        EngineArgs.from_kwargs(kv_cache_dtype="int8")
    parser = argparse.ArgumentParser(prog="tinyserve serve")
    add_engine_flags(parser)
    assert parser.parse_args(["--kv-cache-dtype", "fp8"]).kv_cache_dtype == "fp8"
    with pytest.raises(SystemExit) as exit_info:
        parser.parse_args(["--kv-cache-dtype", "int8"])
    assert exit_info.value.code == 2
    assert "--kv-cache-dtype: invalid choice: 'int8'" in capsys.readouterr().err
