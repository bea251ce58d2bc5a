"""The front end finds a request's spans by its id, and a traced run seeds its sampled requests by a named option."""

import asyncio

import pytest

from tests.tiny_checkpoints import tiny_model_with_tokenizer
from tinyserve import SamplingParams
from tinyserve.config import EngineArgs
from tinyserve.errors import InvalidInputError
from tinyserve.frontend.async_llm import AsyncLLM
from tinyserve.frontend.input_processor import InputProcessor
from tinyserve.frontend.output_processor import OutputKind
from tinyserve.frontend.request_observers import RequestObservers
from tinyserve.lifecycle import schema
from tinyserve.trace_reading.otlp_json import read_spans
from tinyserve.lifecycle.request_spans import NO_SPANS, start_request_spans
from tinyserve.lifecycle.tracing import setup_tracing, shutdown_tracing
from tinyserve.pooling_params import PoolingParams


def test_spans_are_found_by_id_inside_the_block_only_and_one_request_at_a_time():
    observers, spans = RequestObservers(), object()
    assert observers.get("a") is NO_SPANS
    with observers.observing("a", spans):
        assert observers.get("a") is spans and observers.get("b") is NO_SPANS
        with pytest.raises(InvalidInputError, match="already in use"):
            with observers.observing("a", object()):
                pass
        assert observers.get("a") is spans
    assert observers.get("a") is NO_SPANS
    with observers.observing("a", NO_SPANS):  # tracing off: nothing is registered
        assert observers._spans == {}


def processor(seed_unseeded: bool) -> InputProcessor:
    args = EngineArgs(model=str(tiny_model_with_tokenizer("llama")), num_kv_blocks=64)
    from tinyserve.config import ModelInfo
    from tinyserve.models.tokenizer import load_tokenizer

    info = ModelInfo.from_args(args)
    return InputProcessor.from_engine_args(info, load_tokenizer(info.path), args, seed_unseeded=seed_unseeded)


def test_seed_unseeded_draws_a_seed_for_an_unseeded_sampled_request_only():
    on, off = processor(True), processor(False)
    sampled = SamplingParams(temperature=0.8, max_tokens=4)
    assert off.seeded(sampled) is sampled
    seeded = on.seeded(sampled)
    assert sampled.seed is None and 0 <= seeded.seed < 2 ** 63 and seeded.temperature == 0.8
    for untouched in (SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, seed=7), PoolingParams()):
        assert on.seeded(untouched) is untouched


def test_an_in_process_traced_request_has_its_enqueue_and_send_spans_without_a_size(tmp_path):
    trace_file = tmp_path / "api.jsonl"

    async def main():
        engine = await AsyncLLM.create(EngineArgs(model=str(tiny_model_with_tokenizer("llama")), num_kv_blocks=64),
                                       in_process=True, seed_unseeded=True)
        try:
            spans = start_request_spans(schema.OPERATION_TEXT_COMPLETION, "tiny", "r")
            with engine.observers.observing("r", spans):
                stream = await engine.add_request("Simple", SamplingParams(temperature=0.0, max_tokens=3, n=2), "r",
                                                  output_kind=OutputKind.FINAL_ONLY)
            assert engine.observers.get("r") is NO_SPANS and stream.spans is spans
            [output] = [o async for o in stream]
            await stream.close()
            return output
        finally:
            engine.shutdown()

    assert setup_tracing(schema.SERVICE_API, trace_file)
    try:
        output = asyncio.run(main())
    finally:
        shutdown_tracing()
    assert len(output.outputs) == 2
    spans = read_spans(trace_file)
    [request] = [s for s in spans if s.name == "text_completion tiny"]
    [enqueue] = [s for s in spans if s.name == schema.ENQUEUE]
    sends = [s for s in spans if s.name == schema.IPC_SEND]
    assert enqueue.attributes == {schema.REQUEST_ID: "r", schema.ENGINE_INDEX: 0}
    assert sorted(s.attributes[schema.REQUEST_ID] for s in sends) == ["0_r", "1_r"]
    assert all(s.attributes == {schema.REQUEST_ID: s.attributes[schema.REQUEST_ID], schema.ENGINE_INDEX: 0}
               for s in sends)  # nothing crossed a socket: no ipc.bytes
    assert all(s.parent_span_id == request.span_id for s in [enqueue, *sends])
    assert request.attributes[schema.GEN_AI_RESPONSE_FINISH_REASONS] == ["length", "length"]
