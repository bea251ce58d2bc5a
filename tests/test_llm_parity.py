"""Greedy outputs of LLM.generate equal transformers' own greedy generate, token for token."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.tiny_checkpoints import tiny_model_with_tokenizer
from tinyserve import LLM, SamplingParams

# (family, tied embeddings): every family, both embedding layouts somewhere.
MODELS = [("llama", False), ("mistral", True), ("qwen2", True), ("qwen3", False)]
PROMPT_LENGTHS = (5, 17, 40, 70)
MAX_TOKENS = 16


def prompts_for(vocab_size: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(1234)
    return [torch.randint(3, vocab_size, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]


def hf_greedy(folder, prompt: list[int]) -> list[int]:
    model = _hf_model(folder)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False)
    return out[0, len(prompt):].tolist()


_HF_MODELS = {}


def _hf_model(folder):
    if folder not in _HF_MODELS:
        _HF_MODELS[folder] = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return _HF_MODELS[folder]


def generate_ids(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module", params=MODELS, ids=lambda m: f"{m[0]}-{'tied' if m[1] else 'untied'}")
def model_and_reference(request):
    family, tied = request.param
    folder = tiny_model_with_tokenizer(family, tied)
    prompts = prompts_for(_hf_model(folder).config.vocab_size)
    return folder, prompts, [hf_greedy(folder, p) for p in prompts]


def test_greedy_matches_transformers_alone(model_and_reference):
    folder, prompts, expected = model_and_reference
    llm = LLM(str(folder))
    assert [generate_ids(llm, [p])[0] for p in prompts] == expected


def test_greedy_matches_transformers_in_one_mixed_batch(model_and_reference):
    folder, prompts, expected = model_and_reference
    llm = LLM(str(folder))
    assert generate_ids(llm, prompts) == expected


def test_greedy_matches_with_preemption_and_chunked_prefill(model_and_reference):
    folder, prompts, expected = model_and_reference
    # 12 blocks of 16 tokens cannot hold all four requests as they grow (up to 6 blocks each),
    # and a 16-token budget cuts every prompt longer than that into chunks.
    llm = LLM(str(folder), num_kv_blocks=12, block_size=16, max_num_batched_tokens=16)
    assert generate_ids(llm, prompts) == expected
    assert llm.engine_core.scheduler.num_preemptions > 0
    pool = llm.engine_core.kv_cache_manager.pool
    assert pool.num_free_blocks == pool.num_blocks
    pool.check_integrity()
