"""Prompts given as embeddings (--enable-prompt-embeds) generate what the same prompt as token ids does.

Offline: `LLM(..., enable_prompt_embeds=True).generate({"prompt_embeds": tensor})`, for every family,
against transformers' greedy generate from the same `inputs_embeds`. The HTTP cases are in
tests/test_prompt_embeds_server.py.
"""

import pytest
import torch

from tests.hf_reference import MAX_TOKENS, hf_greedy, hf_model
from tests.test_llm_parity import MODELS
from tests.tiny_checkpoints import tiny_model_with_tokenizer
from tinyserve import LLM, SamplingParams
from tinyserve.errors import InvalidInputError
from tinyserve.lifecycle import schema
from tinyserve.trace_reading.run import load_run

GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)


def embeddings(folder, prompt: list[int]) -> torch.Tensor:
    """transformers' input embeddings of the prompt's ids: [len(prompt), hidden_size]."""
    with torch.no_grad():
        return hf_model(folder).get_input_embeddings()(torch.tensor(prompt)).clone()


def hf_greedy_from_embeds(folder, embeds: torch.Tensor) -> list[int]:
    """transformers' greedy generate started from inputs_embeds (it returns the new tokens only)."""
    with torch.no_grad():
        out = hf_model(folder).generate(inputs_embeds=embeds[None], max_new_tokens=MAX_TOKENS, do_sample=False)
    return out[0].tolist()


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("family, tied", MODELS, ids=lambda v: str(v))
def test_prompt_embeds_generate_what_the_same_prompt_as_tokens_does(family, tied):
    folder = tiny_model_with_tokenizer(family, tied)
    generator = torch.Generator().manual_seed(7)
    vocab = hf_model(folder).config.vocab_size
    first, second = (torch.randint(3, vocab, (40,), generator=generator).tolist() for _ in range(2))
    expected = hf_greedy(folder, first)
    assert hf_greedy_from_embeds(folder, embeddings(folder, first)) == expected
    # 16-token blocks and a 16-token budget: the embeddings prompt is prefilled in chunks, beside a token one.
    llm = LLM(str(folder), enable_prompt_embeds=True, block_size=16, max_num_batched_tokens=16)
    outputs = llm.generate([{"prompt_embeds": embeddings(folder, first)}, {"prompt_token_ids": first}], GREEDY,
                           use_tqdm=False)
    assert token_ids(outputs) == [expected, expected]
    assert outputs[0].outputs[0].text == outputs[1].outputs[0].text
    # A second embeddings prompt of the same length: its placeholder ids are the first's, its blocks must not be.
    [other] = llm.generate({"prompt_embeds": embeddings(folder, second)}, GREEDY, use_tqdm=False)
    assert other.outputs[0].token_ids == hf_greedy(folder, second)
    assert other.num_cached_tokens == 0
    # The same embeddings again share the first one's full blocks.
    [again] = llm.generate({"prompt_embeds": embeddings(folder, first)}, GREEDY, use_tqdm=False)
    assert again.outputs[0].token_ids == expected and again.num_cached_tokens == 32


def test_prompt_embeds_are_refused_without_the_flag_and_when_malformed():
    folder = tiny_model_with_tokenizer("llama", False)
    rows = embeddings(folder, [5, 6, 7])
    with pytest.raises(InvalidInputError, match="--enable-prompt-embeds"):
        LLM(str(folder)).generate({"prompt_embeds": rows}, GREEDY, use_tqdm=False)
    llm = LLM(str(folder), enable_prompt_embeds=True)
    for bad, named in [(rows[:, :-1], "hidden_size"), (rows[None].repeat(2, 1, 1), "2-D"),
                       (torch.full_like(rows, float("nan")), "not finite"), (rows.long(), "floating-point"),
                       (rows.repeat(1000, 1), "max_model_len")]:
        with pytest.raises(InvalidInputError, match=named) as error:
            llm.generate({"prompt_embeds": bad}, GREEDY, use_tqdm=False)
        assert error.value.param == "prompt_embeds"
    with pytest.raises(InvalidInputError, match="prompt_logprobs"):
        llm.generate({"prompt_embeds": rows}, SamplingParams(prompt_logprobs=1), use_tqdm=False)
    # a batch of one, [1, rows, hidden], is taken as its rows (as vLLM)
    assert token_ids(llm.generate({"prompt_embeds": rows[None]}, GREEDY, use_tqdm=False)) == \
        token_ids(llm.generate({"prompt_token_ids": [5, 6, 7]}, GREEDY, use_tqdm=False))


def test_a_traced_prompt_embeds_request_says_so_on_its_queue_span(tmp_path):
    folder = tiny_model_with_tokenizer("llama", False)
    llm = LLM(str(folder), enable_prompt_embeds=True, trace_dir=str(tmp_path))
    llm.generate([{"prompt_embeds": embeddings(folder, [5, 6, 7])}, {"prompt_token_ids": [5, 6, 7, 8]}],
                 SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)
    run = load_run(llm.trace_run_dir)
    queues = {len(r.inputs.prompt_token_ids): r.sequences[0].stages[schema.QUEUE] for r in run.requests}
    assert queues[3].attributes[schema.PROMPT_EMBEDS_ROWS] == 3
    assert queues[3].attributes[schema.PROMPT_EMBEDS_HIDDEN_SIZE] == hf_model(folder).config.hidden_size
    assert schema.PROMPT_EMBEDS_ROWS not in queues[4].attributes
