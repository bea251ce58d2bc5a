"""Pooling (--runner pooling): embeddings equal transformers', and a request is one prefill and done.

The reference is transformers' own model: its last hidden state (after the final norm) at the
last prompt position, L2-normalised (vLLM's default for a decoder model), or the mean of every
position's (pooling_type MEAN), for the same token ids.
"""

import asyncio
from pathlib import Path

import pytest
import torch

from tests.hf_reference import hf_model
from tests.tiny_checkpoints import tiny_model_with_tokenizer
from tinyserve import LLM
from tinyserve.config import EngineArgs
from tinyserve.lifecycle import schema
from tinyserve.pooling_params import PoolingParams
from tinyserve.trace_reading.run import load_run

# Long enough (77 tokens) to be computed in three chunks at a budget of 32 tokens.
PROMPTS = [[5, 6, 7, 8, 9, 10] * 5, [11, 12, 13], list(range(3, 80))]


def hf_hidden(folder, prompt: list[int]) -> torch.Tensor:
    """transformers' last hidden states, after the final norm: [len(prompt), hidden_size]."""
    with torch.no_grad():
        return hf_model(folder).model(torch.tensor([prompt])).last_hidden_state[0]


def cosine(vector: list[float], reference: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(torch.tensor(vector), reference, dim=0))


@pytest.fixture(scope="module", params=[("llama", False), ("qwen3", True)], ids=lambda m: m[0])
def folder(request):
    return tiny_model_with_tokenizer(*request.param)


@pytest.fixture(scope="module")
def llm(folder):
    return LLM(str(folder), runner="pooling", max_num_batched_tokens=32)


def test_embeddings_equal_transformers_last_token_pooling_alone_batched_and_chunked(folder, llm):
    batched = llm.embed([{"prompt_token_ids": p} for p in PROMPTS], use_tqdm=False)
    alone = [llm.embed({"prompt_token_ids": p}, use_tqdm=False)[0] for p in PROMPTS]
    for prompt, together, single in zip(PROMPTS, batched, alone):
        reference = torch.nn.functional.normalize(hf_hidden(folder, prompt)[-1], dim=0)
        assert together.prompt_token_ids == prompt
        assert cosine(together.outputs.embedding, reference) >= 0.9999
        assert cosine(single.outputs.embedding, reference) >= 0.9999
        assert together.outputs.hidden_size == hf_model(folder).config.hidden_size
        assert abs(torch.tensor(together.outputs.embedding).norm().item() - 1.0) < 1e-5
    assert llm.engine_core.kv_cache_manager.pool.num_used_blocks == 0


def test_texts_are_tokenized_as_the_tokenizer_does_and_normalize_false_gives_the_raw_state(folder, llm):
    text = "the quick brown fox"
    ids = llm.get_tokenizer()(text)["input_ids"]
    [by_text] = llm.embed(text, use_tqdm=False)
    assert by_text.prompt_token_ids == ids
    [raw] = llm.encode(text, PoolingParams(normalize=False), use_tqdm=False)
    torch.testing.assert_close(raw.outputs.data, hf_hidden(folder, ids)[-1], rtol=1e-4, atol=1e-4)


def test_mean_pooling_averages_every_position_across_chunks(folder):
    engine_args = EngineArgs.from_kwargs(model=str(folder), runner="pooling",
                                         pooler_config={"pooling_type": "mean"})
    assert engine_args.enable_prefix_caching is False  # a cached prefix has no hidden states to average
    llm = LLM(str(folder), runner="pooling", max_num_batched_tokens=32, pooler_config={"pooling_type": "MEAN"})
    outputs = llm.embed([{"prompt_token_ids": p} for p in PROMPTS], use_tqdm=False)
    for prompt, output in zip(PROMPTS, outputs):
        reference = torch.nn.functional.normalize(hf_hidden(folder, prompt).mean(dim=0), dim=0)
        assert cosine(output.outputs.embedding, reference) >= 0.9999


def test_a_pooling_request_is_prefill_steps_then_finished_never_a_decode(llm):
    prompt = list(range(79, 2, -1))  # 77 tokens no other test sends: chunks of 32, 32 and 13
    steps, first = _run_alone(llm, "p", prompt)
    assert steps == [[(0, 32, True)], [(32, 32, True)], [(64, 13, True)]]
    assert first.finished and first.outputs.data.shape == (hf_model_hidden_size(llm),)
    assert llm.engine_core.kv_cache_manager.pool.num_used_blocks == 0
    # Again: its first 64 tokens' KV is in the prefix cache, the last 13 are computed, the vector is the same.
    steps, again = _run_alone(llm, "q", prompt)
    assert steps == [[(64, 13, True)]] and again.num_cached_tokens == 64
    torch.testing.assert_close(again.outputs.data, first.outputs.data)


def _run_alone(llm, request_id: str, prompt: list[int]):
    """Step one pooling request to its end: what each step scheduled (computed, new, is_prefill), its output."""
    steps, outputs = [], []
    llm.llm_engine.add_request(request_id, *_made(llm, request_id, prompt))
    while llm.llm_engine.has_unfinished_requests:
        outputs += llm.llm_engine.step()
        scheduled = llm.engine_core.last_scheduler_output.scheduled
        if scheduled:
            steps.append([(s.num_computed_tokens, s.num_new_tokens, s.is_prefill) for s in scheduled])
    [output] = outputs
    return steps, output


def _made(llm, request_id, prompt):
    from tinyserve.frontend.render import ProcessedPrompt

    processed = ProcessedPrompt(None, prompt)
    params = PoolingParams()
    return processed, params, llm.llm_engine.make_requests(request_id, processed, params)


def hf_model_hidden_size(llm) -> int:
    return llm.engine_core.model_runner.model.config.hidden_size


def test_a_pooling_engine_refuses_to_generate_and_a_generating_one_to_embed(folder, llm):
    with pytest.raises(ValueError, match="pooling .embedding. model .--runner pooling.: it computes embeddings"):
        llm.generate("hello", use_tqdm=False)
    generating = LLM(str(folder), num_kv_blocks=8)
    with pytest.raises(ValueError, match="generative model .* --runner pooling"):
        generating.embed("hello", use_tqdm=False)


@pytest.mark.parametrize("kwargs, message", [
    ({"runner": "pooling", "pooler_config": {"pooling_type": "ALL"}}, "pooling_type must be one of"),
    ({"runner": "pooling", "pooler_config": {"softmax": True}}, r"unknown field\(s\) \['softmax'\]"),
    ({"runner": "pooling", "tensor_parallel_size": 2}, "tensor_parallel_size must be 1"),
    ({"runner": "generate", "pooler_config": {"pooling_type": "LAST"}}, "pooler_config is for runner='pooling'"),
    ({"runner": "generate", "convert": "embed"}, "convert='embed' makes an embedding model"),
    ({"convert": "classify"}, "convert must be one of"),
    ({"runner": "reward"}, "runner must be one of"),
])
def test_pooling_settings_that_cannot_work_are_refused_naming_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineArgs.from_kwargs(**kwargs)


def test_convert_embed_makes_a_pooling_engine():
    assert EngineArgs.from_kwargs(convert="embed").runner == "pooling"
    assert EngineArgs.from_kwargs().runner == "generate"


def test_dimensions_are_refused_since_no_model_here_is_matryoshka_trained():
    with pytest.raises(ValueError, match="dimensions=8: this model does not support Matryoshka"):
        PoolingParams(dimensions=8)


def test_a_traced_pooling_run_logs_its_inputs_and_shows_prefill_steps_only(folder, tmp_path):
    llm = LLM(str(folder), runner="pooling", max_num_batched_tokens=32, trace_dir=str(tmp_path))
    llm.embed([{"prompt_token_ids": p} for p in PROMPTS], PoolingParams(normalize=False), use_tqdm=False)
    run = load_run(llm.trace_run_dir)
    assert sorted(r.operation for r in run.requests) == [schema.OPERATION_EMBEDDINGS] * len(PROMPTS)
    for request in run.requests:
        assert request.inputs.pooling_params == {"normalize": False}
        assert request.inputs.prompt_token_ids in PROMPTS
        assert request.request_span.attributes[schema.POOLING_DIMENSIONS] == hf_model_hidden_size(llm)
        assert [c.finish_reason for c in request.completions] == ["stop"]
    served = [step for step in run.steps if step.request_ids]
    assert served and all(step.num_decode_requests == 0 for step in served)
    assert sum(step.num_prefill_tokens for step in served) == sum(map(len, PROMPTS))


def test_async_llm_encode_yields_one_finished_output_with_the_offline_vector(folder, llm):
    from tinyserve.frontend.async_llm import AsyncLLM

    async def main():
        engine = AsyncLLM(EngineArgs.from_kwargs(model=str(folder), runner="pooling"), in_process=True)
        try:
            return [output async for output in engine.encode({"prompt_token_ids": PROMPTS[1]}, PoolingParams(), "a")]
        finally:
            engine.shutdown()

    [output] = asyncio.run(main())
    [offline] = llm.encode({"prompt_token_ids": PROMPTS[1]}, use_tqdm=False)
    assert output.finished and output.request_id == "a"
    torch.testing.assert_close(output.outputs.data, offline.outputs.data)


def test_the_inputs_of_one_http_request_each_own_their_engine_spans_in_a_recorded_run():
    """recorded-pooling's last request carries three inputs: three request spans under one HTTP span, in one trace."""
    run = load_run(Path(__file__).resolve().parents[1] / "traces" / "recorded-pooling")
    shared = [r for r in run.requests if r.http_span is not None
              and sum(o.http_span is not None and o.http_span.span_id == r.http_span.span_id for o in run.requests) == 3]
    assert len(shared) == 3
    for request in run.requests:
        [sequence] = request.sequences
        assert sequence.request_id == request.request_id
        assert request.inputs.pooling_params == {} and request.num_output_tokens == 0
    served = [step for step in run.steps if step.request_ids]
    assert all(step.num_decode_requests == 0 for step in served)
    assert max(step.num_scheduled_tokens for step in served) == 64  # the budget, filled by chunks
