"""The library API's edges, each a case a randomized harness once broke: ids, limits, seeds."""

import asyncio

import pytest

from tests.tiny_checkpoints import tiny_model_with_tokenizer
from tinyserve import LLM, AsyncLLM, EngineArgs, SamplingParams
from tinyserve.frontend.output_processor import OutputKind


@pytest.fixture(scope="module")
def model() -> str:
    return str(tiny_model_with_tokenizer("llama"))


@pytest.fixture(scope="module")
def llm(model) -> LLM:
    return LLM(model, num_kv_blocks=64)


def run_async(model, scenario):
    async def main():
        engine = await AsyncLLM.create(EngineArgs(model=model, num_kv_blocks=64), in_process=True)
        try:
            return await scenario(engine)
        finally:
            engine.shutdown()
    return asyncio.run(main())


def test_a_request_id_that_looks_like_a_samples_id_is_refused_while_that_sample_runs(model):
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, n=2)

    async def scenario(engine):
        parent = await engine.add_request("Flat is better", params, "x", output_kind=OutputKind.FINAL_ONLY)
        with pytest.raises(ValueError, match="clashes|in use"):
            await engine.add_request("Sparse", SamplingParams(max_tokens=4), "0_x")
        with pytest.raises(ValueError, match="in use"):
            await engine.add_request("Sparse", SamplingParams(max_tokens=4), "x")
        [x] = [o async for o in parent]
        await parent.close()
        # The other way round: "0_y" runs, then "y" with n = 2 would give a sample that id.
        plain = await engine.add_request("Sparse", SamplingParams(max_tokens=24, ignore_eos=True), "0_y",
                                         output_kind=OutputKind.FINAL_ONLY)
        with pytest.raises(ValueError, match="clashes"):
            await engine.add_request("Sparse", params, "y")
        [y] = [o async for o in plain]
        await plain.close()
        return x, y

    x, y = run_async(model, scenario)
    assert x.finished and [len(c.token_ids) for c in x.outputs] == [24, 24]
    assert all(c.finish_reason == "length" for c in x.outputs)
    assert y.finished and len(y.outputs[0].token_ids) == 24


@pytest.mark.parametrize("field", ["logprobs", "prompt_logprobs"])
def test_more_logprobs_than_the_limit_are_a_value_error_naming_the_field_and_the_limit(llm, field):
    with pytest.raises(ValueError, match=rf"{field}=10000 .* 20 "):
        llm.generate("Now is better than never.", SamplingParams(max_tokens=2, **{field: 10_000}), use_tqdm=False)
    [output] = llm.generate("Now is better than never.", SamplingParams(max_tokens=2, **{field: 20}),
                            use_tqdm=False)
    assert output.finished


def test_more_logprobs_than_the_vocabulary_leave_the_async_engine_healthy(model):
    async def scenario(engine):
        huge = SamplingParams(max_tokens=2, logprobs=10**6)
        with pytest.raises(ValueError, match="logprobs"):
            await engine.add_request("Hello", huge, "huge")
        outputs = [o async for o in engine.generate("Hello", SamplingParams(max_tokens=3), "after",
                                                     output_kind=OutputKind.FINAL_ONLY)]
        return engine.is_healthy, outputs

    healthy, [output] = run_async(model, scenario)
    assert healthy and output.finished


def test_the_largest_seed_works_with_several_samples(llm):
    params = SamplingParams(temperature=1.0, seed=2**63 - 1, n=3, max_tokens=8, ignore_eos=True)
    first = llm.generate("Simple is better", params, use_tqdm=False)[0]
    again = llm.generate("Simple is better", params, use_tqdm=False)[0]
    assert [c.token_ids for c in first.outputs] == [c.token_ids for c in again.outputs]
    assert len({tuple(c.token_ids) for c in first.outputs}) > 1  # the samples differ: seeds wrapped, not equal
