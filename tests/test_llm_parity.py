"""Greedy outputs of LLM.generate equal transformers' own greedy generate, token for token."""

import pytest
import torch

from tests.hf_reference import MAX_TOKENS, hf_greedy, hf_model
from tests.tiny_checkpoints import tiny_model_with_tokenizer
from tinyserve import LLM, SamplingParams

# (family, tied embeddings): every family, both embedding layouts somewhere.
MODELS = [("llama", False), ("mistral", True), ("qwen2", True), ("qwen3", False)]
PROMPT_LENGTHS = (5, 17, 40, 70)


def prompts_for(vocab_size: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(1234)
    return [torch.randint(3, vocab_size, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]


def generate_ids(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module", params=MODELS, ids=lambda m: f"{m[0]}-{'tied' if m[1] else 'untied'}")
def model_and_reference(request):
    family, tied = request.param
    folder = tiny_model_with_tokenizer(family, tied)
    prompts = prompts_for(hf_model(folder).config.vocab_size)
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


def hf_prompt_logprobs(folder, prompt: list[int]) -> torch.Tensor:
    """log_softmax of transformers' logits at every prompt position: row p predicts token p + 1."""
    with torch.no_grad():
        logits = hf_model(folder)(torch.tensor([prompt])).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


@pytest.mark.parametrize("engine_kwargs", [
    {},
    # Chunked prefill (16-token budget) and preemption (12 blocks of 16 for four growing requests).
    {"num_kv_blocks": 12, "block_size": 16, "max_num_batched_tokens": 16},
    # 8 blocks: the 70-token prompt is preempted in the middle of its prefill, with part of
    # its prompt logprobs computed; recomputed, it must not get those positions twice.
    {"num_kv_blocks": 8, "block_size": 16, "max_num_batched_tokens": 16},
], ids=["plain", "chunked-preempted", "preempted-mid-prefill"])
def test_prompt_logprobs_equal_transformers(model_and_reference, engine_kwargs):
    folder, prompts, _ = model_and_reference
    llm = LLM(str(folder), **engine_kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, prompt_logprobs=2)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert (llm.engine_core.scheduler.num_preemptions > 0) == bool(engine_kwargs)
    for prompt, output in zip(prompts, outputs):
        want = hf_prompt_logprobs(folder, prompt)
        assert len(output.prompt_logprobs) == len(prompt) and output.prompt_logprobs[0] is None
        for position, entry in enumerate(output.prompt_logprobs[1:]):
            token = prompt[position + 1]
            row = want[position]
            assert entry[token].logprob == pytest.approx(row[token].item(), abs=1e-4)
            assert entry[token].rank == int((row >= row[token]).sum())  # tokens at least as likely
            top_ids = row.topk(2).indices.tolist()
            assert {t for t, lp in entry.items() if lp.rank <= 2} == set(top_ids)
