"""Lark grammars under both backends: llguidance reads them, xgrammar reads their EBNF form (lark.py)."""

import re

import pytest

from tests.tiny_checkpoints import tiny_model_with_tokenizer
from tinyserve import LLM, SamplingParams
from tinyserve.config import EngineArgs
from tinyserve.structured_output import GrammarError
from tinyserve.structured_output.lark import convert_lark_to_ebnf, grammar_is_likely_lark
from tinyserve.sampling_params import StructuredOutputsParams

# (a Lark grammar, the regex every output it allows must match)
GRAMMARS = [
    ('start: "a" ("b" | "c") "d"', r"a[bc]d"),
    ('// a comment\n?start: greeting  # another\ngreeting: "hi" "!"\n    | "yo" "?"\n', r"hi!|yo\?"),
    ('start: NUMBER "!"\nNUMBER: /[0-9]{1,3}/', r"[0-9]{1,3}!"),
    ('start: letter letter\nletter: "x".."z"', r"[x-z]{2}"),
]


@pytest.fixture(scope="module", params=["xgrammar", "guidance"])  # "guidance": vLLM's name for llguidance
def llm(request):
    return LLM(str(tiny_model_with_tokenizer("llama")), num_kv_blocks=64, structured_outputs_backend=request.param)


@pytest.mark.parametrize("grammar, language", GRAMMARS)
def test_a_lark_grammar_constrains_the_output_under_either_backend(llm, grammar, language):
    params = SamplingParams(max_tokens=20, temperature=1.0, seed=3, n=3,
                            structured_outputs=StructuredOutputsParams(grammar=grammar))
    [output] = llm.generate("Say something", params, use_tqdm=False)
    for completion in output.outputs:
        assert re.fullmatch(language, completion.text), completion.text
        assert completion.finish_reason == "stop"  # the grammar was complete: only EOS could follow


def test_guidance_is_vllms_name_for_llguidance():
    assert EngineArgs(structured_outputs_backend="guidance").structured_outputs_backend == "guidance"
    args = EngineArgs.from_kwargs(structured_outputs_backend="guidance")
    assert args.structured_outputs_backend == "llguidance"


def test_the_converter_writes_xgrammars_ebnf_and_leaves_ebnf_alone():
    assert not grammar_is_likely_lark('root ::= "a" | "b"')
    assert grammar_is_likely_lark('start: "a"')
    assert convert_lark_to_ebnf('start: "a" | "b"\n  | "c"') == 'root ::= start\nstart ::= "a" | "b" | "c"\n'
    assert convert_lark_to_ebnf('root: x\nx: "1"') == 'root ::= x\nx ::= "1"\n'  # a root of its own is kept
    assert convert_lark_to_ebnf('start: "//# not a comment" /a\\/b/') == 'root ::= start\nstart ::= "//# not a comment" (a\\/b)\n'
    assert convert_lark_to_ebnf('?start.2: other\n!other: "k"') == 'root ::= start\nstart ::= other\nother ::= "k"\n'


@pytest.mark.parametrize("grammar, words", [
    ('start: NUMBER\n%import common.NUMBER', "%import"),
    ('start: /abc/i', "regex flags"),
    ('| "a"', "before any rule"),
])
def test_what_ebnf_cannot_say_is_refused_naming_llguidance_or_the_line(grammar, words):
    with pytest.raises(GrammarError, match=words):
        convert_lark_to_ebnf(grammar)
