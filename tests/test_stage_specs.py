"""One fast test per stage of the journey, to read beside its code (docs/design.md, section 7, lists them).

No server and no engine process: each stage is called as the stage before it would call it.
"""

import msgspec
import pytest

from tests.hf_reference import MAX_TOKENS, hf_greedy
from tests.tiny_checkpoints import tiny_model_with_tokenizer
from tinyserve.config import EngineArgs, ModelInfo
from tinyserve.engine.core.scheduler_output import NewRequestData, SchedulerOutput
from tinyserve.assemble import build_engine_core
from tinyserve.errors import InvalidInputError
from tinyserve.frontend.input_processor import InputProcessor
from tinyserve.models.tokenizer import load_tokenizer
from tinyserve.sampling_params import SamplingParams
from tinyserve.wire.ipc import INPUT_TYPES, OUTPUT_TYPES, EngineInputKind, EngineOutputKind, MessageDecoder
from tinyserve.wire.messages import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, SchedulerStats

BLOCK_SIZE = 4


@pytest.fixture(scope="module")
def folder():
    return tiny_model_with_tokenizer("llama")


@pytest.fixture(scope="module")
def core(folder):
    core = build_engine_core(EngineArgs(model=str(folder), num_kv_blocks=32, block_size=BLOCK_SIZE))
    yield core
    core.shutdown()


def new_request(request_id, token_ids, computed, new, blocks) -> NewRequestData:
    return NewRequestData(request_id, computed, new, samples_token=computed + new == len(token_ids),
                          is_prefill=computed + new <= len(token_ids), prompt_token_ids=token_ids,
                          sampling_params=SamplingParams(), eos_token_ids=[], block_ids=blocks, output_token_ids=[])


def test_prepare_inputs_flattens_the_batch_as_the_model_runners_table_says(core):
    """model_runner.py's table: A a prefill chunk of 4 after 4 computed, B a decode at 9, C a fresh prefill of 3."""
    a, b, c = list(range(100, 112)), list(range(200, 210)), [300, 301, 302]
    step = SchedulerOutput(step_id=1, scheduled_new_requests=[
        new_request("A", a, 4, 4, [7, 2, 9]), new_request("B", b, 9, 1, [5, 6, 11]), new_request("C", c, 0, 3, [3])])
    runner = core.model_runner
    runner.update_states(step)
    try:
        inputs = runner.prepare_inputs(step)
    finally:
        runner.update_states(SchedulerOutput(step_id=2, finished_request_ids=["A", "B", "C"]))
    assert inputs.input_ids.tolist() == [104, 105, 106, 107, 209, 300, 301, 302]  # a4..a7, b9, c0..c2
    assert inputs.positions.tolist() == [4, 5, 6, 7, 9, 0, 1, 2]
    # block_table[pos // bs] * bs + pos % bs: A's positions 4-7 are its second block, 2
    assert inputs.metadata.slot_mapping.tolist() == [8, 9, 10, 11, 11 * 4 + 1, 12, 13, 14]
    assert list(inputs.metadata.query_start_loc_cpu) == [0, 4, 5, 8]
    assert list(inputs.metadata.seq_lens_cpu) == [8, 10, 3]
    # Logits only where a request reaches the end of its known tokens: not A's chunk.
    assert inputs.logits_indices.tolist() == [4, 7] and inputs.sampling_request_ids == ["B", "C"]


def test_one_request_goes_through_schedule_execute_and_update_to_transformers_tokens(core, folder):
    prompt = [5, 9, 33, 71, 120, 7]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    core.add_request(EngineCoreRequest("one", prompt, params, eos_token_ids=[], arrival_time=0.0))
    tokens = []
    first = core.scheduler.schedule()  # the whole prompt fits the budget: one prefill
    assert [(s.request_id, s.num_computed_tokens, s.num_new_tokens) for s in first.scheduled] == [("one", 0, 6)]
    scheduler_output = first
    while True:
        runner_output = core.model_runner.execute_model(scheduler_output)
        outputs = core.scheduler.update_from_output(scheduler_output, runner_output)
        tokens += outputs[0].new_token_ids
        if outputs[0].finished:
            break
        scheduler_output = core.scheduler.schedule()
        assert [(s.num_computed_tokens, s.num_new_tokens) for s in scheduler_output.scheduled] == \
            [(len(prompt) + len(tokens) - 1, 1)]  # one decode: the token sampled last
    assert tokens == hf_greedy(folder, prompt) and outputs[0].finish_reason == "length"
    core.step()  # tells the worker the request finished
    assert core.model_runner.requests == {} and core.kv_cache_manager.pool.num_used_blocks == 0


def test_the_wires_messages_decode_into_their_own_types_without_a_process():
    request = EngineCoreRequest("r1", [1, 2, 3], SamplingParams(temperature=0.5, seed=7, max_tokens=9), [2], 1.5,
                                priority=3, trace_context={"traceparent": "00-" + "a" * 32 + "-" + "b" * 16 + "-01"})
    kind, decoded = MessageDecoder(EngineInputKind, INPUT_TYPES).decode(
        [EngineInputKind.ADD.value, msgspec.msgpack.encode(request)])
    assert kind is EngineInputKind.ADD and decoded == request
    outputs = EngineCoreOutputs(engine_index=1, timestamp=2.0, outputs=[
        EngineCoreOutput("r1", new_token_ids=[42], finish_reason="stop", stop_reason=2)],
        scheduler_stats=SchedulerStats(num_running_reqs=1))
    kind, decoded = MessageDecoder(EngineOutputKind, OUTPUT_TYPES).decode(
        [EngineOutputKind.OUTPUTS.value, msgspec.msgpack.encode(outputs)])
    assert kind is EngineOutputKind.OUTPUTS and decoded == outputs and decoded.outputs[0].finished
    with pytest.raises(ValueError, match="malformed ADD message"):
        MessageDecoder(EngineInputKind, INPUT_TYPES).decode([EngineInputKind.ADD.value, msgspec.msgpack.encode(outputs)])


def test_rendering_and_validation_need_no_server(folder):
    processor = InputProcessor(ModelInfo.from_args(EngineArgs(model=str(folder))), load_tokenizer(str(folder)),
                               BLOCK_SIZE)
    messages = [{"role": "user", "content": "Hello"}]
    text = processor.render_chat(messages)
    assert "Hello" in text and text != processor.render_chat(messages, add_generation_prompt=False)
    prompt = processor.tokenize_chat(messages)
    assert prompt.prompt == text and prompt.prompt_token_ids == processor.encode(text, add_special_tokens=False)
    assert "robot" in processor.render_chat([{"role": "robot", "content": "hi"}])  # any role reaches the template
    with pytest.raises(InvalidInputError, match="role must be a non-empty string"):
        processor.tokenize_chat([{"role": 7, "content": "hi"}])
    with pytest.raises(InvalidInputError, match="more than max_model_len") as refused:
        processor.tokenize_prompt("x" * (processor.model_info.max_model_len * processor.max_chars_per_token + 1))
    assert refused.value.param == "prompt"
