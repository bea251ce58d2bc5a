"""Greedy tokens with the Triton kernels (through the interpreter on CPU) equal transformers'."""

import pytest

from tests.hf_reference import hf_greedy
from tests.tiny_checkpoints import tiny_model_with_tokenizer
from tinyserve import LLM, SamplingParams

pytestmark = pytest.mark.interpreter

PROMPTS = [[5, 9, 33, 71, 120], list(range(40, 75)), [200, 3, 17]]


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_triton_backend_greedy_matches_transformers(family):
    folder = tiny_model_with_tokenizer(family)
    expected = [hf_greedy(folder, p) for p in PROMPTS]
    # A small token budget mixes chunked prefill with decodes in one batch,
    # so both kernels (varlen prefill and decode) run.
    llm = LLM(str(folder), attention_backend="triton", num_kv_blocks=32, max_num_batched_tokens=24)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                           SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected


def test_triton_backend_is_really_used():
    llm = LLM(str(tiny_model_with_tokenizer("llama")), attention_backend="triton", num_kv_blocks=8)
    backends = {type(layer.self_attn.backend).__name__ for layer in llm.engine_core.model_runner.model.layers}
    assert backends == {"TritonAttentionBackend"}
