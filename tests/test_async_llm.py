"""AsyncLLM: the same outputs in-process, over one engine process, and over two (data parallel)."""

import asyncio

import pytest

from tests.tiny_checkpoints import tiny_model_with_tokenizer
from tinyserve import LLM, SamplingParams
from tinyserve.config import EngineArgs
from tinyserve.frontend.async_llm import AsyncLLM
from tinyserve.frontend.output_processor import OutputKind

PROMPTS = ["Beautiful is better than ugly.", "Explicit is better", "Simple", "Complex is better than complicated."]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12)


def engine_args() -> EngineArgs:
    return EngineArgs(model=str(tiny_model_with_tokenizer("llama")), num_kv_blocks=64)


async def generate_all(engine: AsyncLLM, params=GREEDY, kind=OutputKind.FINAL_ONLY):
    async def one(i, prompt):
        outputs = [o async for o in engine.generate(prompt, params, f"req-{i}", output_kind=kind)]
        return outputs
    return await asyncio.gather(*[one(i, p) for i, p in enumerate(PROMPTS)])


def run(coroutine_factory, **kwargs):
    async def main():
        engine = await AsyncLLM.create(engine_args(), **kwargs)
        try:
            return await coroutine_factory(engine)
        finally:
            engine.shutdown()
    return asyncio.run(main())


@pytest.fixture(scope="module")
def offline_outputs():
    outputs = LLM(engine_args().model, num_kv_blocks=64).generate(PROMPTS, GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("kwargs", [{"in_process": True}, {},
                                    pytest.param({"data_parallel_size": 2}, marks=pytest.mark.slow)],
                         ids=["in-process", "one-engine-process", "two-engine-processes"])
def test_same_greedy_outputs_through_every_client(offline_outputs, kwargs):
    results = run(generate_all, **kwargs)
    assert [r[-1].outputs[0].token_ids for r in results] == offline_outputs


@pytest.mark.parametrize("params", [GREEDY, SamplingParams(temperature=0.0, max_tokens=12, stop=["never appears"])],
                         ids=["plain", "with-a-stop-string-never-hit"])
def test_streamed_deltas_concatenate_to_the_full_output(params):
    # With a stop string the detokenizer holds back a tail that might start one; the
    # last delta must release it.
    async def both(engine):
        full = await generate_all(engine, params)
        deltas = await generate_all(engine, params, kind=OutputKind.DELTA)
        return full, deltas

    full, deltas = run(both, in_process=True)
    for whole, pieces in zip(full, deltas):
        assert len(pieces) > 1 and pieces[-1].finished and not any(p.finished for p in pieces[:-1])
        assert "".join(p.outputs[0].text for p in pieces) == whole[-1].outputs[0].text
        assert [t for p in pieces for t in p.outputs[0].token_ids] == whole[-1].outputs[0].token_ids


def test_n_3_fans_out_and_back_into_one_output():
    async def three(engine):
        params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=6)
        return [o async for o in engine.generate("Readability counts.", params, "fan", output_kind=OutputKind.FINAL_ONLY)]

    [output] = run(three)
    assert [c.index for c in output.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 6 for c in output.outputs)


def test_leaving_a_stream_early_aborts_the_request_and_frees_its_blocks():
    async def leave(engine):
        params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
        async for output in engine.generate("Now is better than never.", params, "leaver"):
            if len(output.outputs[0].token_ids):
                break
        for _ in range(50):
            [stats] = await engine.get_stats()
            if stats.num_running_reqs == 0 and stats.num_kv_blocks_used == 0:
                return stats
            await asyncio.sleep(0.1)
        return stats

    stats = run(leave)
    assert stats.num_running_reqs == 0 and stats.num_kv_blocks_used == 0


def test_bad_input_raises_before_anything_is_sent():
    async def bad(engine):
        with pytest.raises(ValueError, match="outside the vocabulary"):
            async for _ in engine.generate({"prompt_token_ids": [10**7]}, GREEDY, "bad"):
                pass
        assert not engine.output_processor.parents
        return [o async for o in engine.generate("still fine", GREEDY, "good", output_kind=OutputKind.FINAL_ONLY)]

    [output] = run(bad, in_process=True)
    assert output.finished


@pytest.mark.parametrize("kwargs", [{"in_process": True}, {}], ids=["in-process", "one-engine-process"])
def test_abort_ends_the_callers_iterator_and_is_idempotent(kwargs):
    long = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)

    async def abort_midway(engine):
        received = []

        async def read():
            async for output in engine.generate("Errors should never pass silently.", long, "to-abort"):
                received.append(output)
                if len(received) == 3:
                    await engine.abort("to-abort")

        await asyncio.wait_for(read(), timeout=30)  # the iterator must end, not wait forever
        await engine.abort("to-abort")  # again: harmless
        await engine.abort("never-existed")
        after = [o async for o in engine.generate("Simple", GREEDY, "after", output_kind=OutputKind.FINAL_ONLY)]
        return received, after

    received, [after] = run(abort_midway, **kwargs)
    assert 3 <= len(received) < 400 and not any(o.finished for o in received)
    assert after.finished and len(after.outputs[0].token_ids) == GREEDY.max_tokens


def test_offline_and_online_paths_give_identical_outputs_for_seeded_requests():
    # Sampled, seeded, n = 2, with penalties and a stop string: every front-end step
    # (fan-out, child seeds, detokenizing, stop strings) runs on both paths.
    params = [SamplingParams(temperature=0.9, top_p=0.9, seed=100 + i, n=2, max_tokens=16, stop=["is"],
                             presence_penalty=0.5) for i in range(len(PROMPTS))]
    offline = LLM(engine_args().model, num_kv_blocks=64).generate(PROMPTS, params, use_tqdm=False)

    async def online(engine):
        async def one(i):
            [output] = [o async for o in engine.generate(PROMPTS[i], params[i], f"r{i}",
                                                         output_kind=OutputKind.FINAL_ONLY)]
            return output
        return await asyncio.gather(*[one(i) for i in range(len(PROMPTS))])

    served = run(online)  # an engine process behind AsyncLLM, as the server runs it

    def completions(outputs):
        return [[(c.index, c.text, list(c.token_ids), c.finish_reason) for c in o.outputs] for o in outputs]

    assert completions(served) == completions(offline)
    assert len({tuple(c[2]) for o in completions(offline) for c in o}) > 1  # really sampled: not one answer everywhere


def test_async_llm_from_the_package_with_vllms_names_streams_and_aborts():
    from tinyserve import AsyncLLM as PublicAsyncLLM
    from tinyserve import EngineArgs as PublicEngineArgs

    async def main():
        engine = PublicAsyncLLM.from_engine_args(PublicEngineArgs(model=engine_args().model, num_kv_blocks=64))
        try:
            texts = []
            params = SamplingParams(temperature=0.8, seed=1, max_tokens=300, ignore_eos=True)
            async for output in engine.generate("Readability counts", params, request_id="r1"):
                texts.append(output.outputs[0].text)
                if len(texts) == 5:
                    await engine.abort("r1")
            return texts
        finally:
            engine.shutdown()
            engine.shutdown()  # twice: harmless

    texts = asyncio.run(main())
    assert len(texts) == 5 and all(isinstance(t, str) for t in texts)  # nothing more once abort() returned
