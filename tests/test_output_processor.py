"""OutputProcessor: how a request's end is decided from the engine's output and the text.

The engine ends a request on max_tokens ("length") or a stop token ("stop"); stop
strings are found here, in the text. When both happen in the same step, the stop
string wins (vLLM's rule): the text was cut there.
"""

import pytest

from tests.tiny_tokenizer import tiny_tokenizer_files
from tinyserve.wire.messages import EngineCoreOutput
from tinyserve.frontend.output_processor import OutputKind, OutputProcessor
from tinyserve.models.tokenizer import EOS_TOKEN, load_tokenizer
from tinyserve.sampling_params import SamplingParams

TEXT = " Beautiful is better than ugly."


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return load_tokenizer(tiny_tokenizer_files(tmp_path_factory.mktemp("tokenizer")))


def run(tokenizer, params: SamplingParams, token_ids: list[int], finish_reason: str, stop_reason=None):
    """Feed token_ids one step each, the engine finishing the request on the last; returns the
    final CompletionOutput and the ids the processor asked the engine to abort."""
    processor = OutputProcessor(tokenizer)
    processor.add_request("r", None, tokenizer.encode(" The Zen"), params, OutputKind.FINAL_ONLY)
    final, aborts = None, []
    for step, token_id in enumerate(token_ids):
        last = step == len(token_ids) - 1
        output = EngineCoreOutput("r", [token_id], finish_reason=finish_reason if last else None,
                                  stop_reason=stop_reason if last else None)
        processed = processor.process_outputs([output])
        aborts += processed.reqs_to_abort
        assert output.finish_reason == (finish_reason if last else None)  # the engine's message is left alone
        if processed.request_outputs:
            final = processed.request_outputs[0].outputs[0]
    assert processor.num_unfinished == 0
    return final, aborts


def ids_through(tokenizer, text: str, end: str) -> list[int]:
    """The shortest prefix of text's ids whose decoded text contains `end`."""
    ids = tokenizer.encode(text)
    return next(ids[:n] for n in range(1, len(ids) + 1) if end in tokenizer.decode(ids[:n]))


def test_a_stop_string_completed_by_the_last_allowed_token_finishes_with_stop(tokenizer):
    ids = ids_through(tokenizer, TEXT, "better")
    params = SamplingParams(max_tokens=len(ids), stop=["better"], temperature=0.0)
    final, aborts = run(tokenizer, params, ids, finish_reason="length")
    assert (final.text, final.finish_reason, final.stop_reason) == (" Beautiful is ", "stop", "better")
    assert aborts == []  # the engine has already finished it


def test_a_stop_string_before_the_engine_finishes_aborts_the_request_there(tokenizer):
    ids = tokenizer.encode(TEXT)
    params = SamplingParams(max_tokens=len(ids), stop=["better"], temperature=0.0)
    processor = OutputProcessor(tokenizer)
    processor.add_request("r", None, [], params, OutputKind.FINAL_ONLY)
    aborts, finals = [], []
    finishes = {}
    for token_id in ids:
        processed = processor.process_outputs([EngineCoreOutput("r", [token_id])])
        aborts += processed.reqs_to_abort
        finishes.update(processed.stop_string_finishes)
        finals += [r.outputs[0] for r in processed.request_outputs]
    assert aborts == ["r"] and finishes == {"r": "stop"}  # what the metrics count
    assert [(f.text, f.finish_reason, f.stop_reason) for f in finals] == [(" Beautiful is ", "stop", "better")]


def test_stop_strings_wait_for_min_tokens(tokenizer):
    ids = tokenizer.encode(TEXT)
    through_better = len(ids_through(tokenizer, TEXT, "better"))
    params = SamplingParams(max_tokens=len(ids), min_tokens=through_better, stop=["better", "ugly"], temperature=0.0)
    final, _ = run(tokenizer, params, ids, finish_reason="length")
    assert (final.text, final.stop_reason) == (" Beautiful is better than ", "ugly")


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_the_eos_token_that_ended_a_request_is_not_in_its_text(tokenizer, skip_special_tokens):
    eos = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    ids = tokenizer.encode(TEXT) + [eos]
    params = SamplingParams(max_tokens=64, skip_special_tokens=skip_special_tokens, temperature=0.0)
    final, _ = run(tokenizer, params, ids, finish_reason="stop")
    assert (final.text, final.finish_reason) == (TEXT, "stop")
    assert final.token_ids == ids  # the token is still reported; only its text is left out
