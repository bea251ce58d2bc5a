"""Lark grammars under both backends, as vLLM takes them in structured_outputs.grammar.

llguidance reads Lark itself, and so does xgrammar 0.2 (`Grammar.from_lark`); an older
xgrammar reads the EBNF that structured_output/lark.py writes (vLLM's convert_lark_to_ebnf),
run here as well by hiding from_lark. A random-weight model never emits EOS on its own, so a
finite grammar that every output matches in full, ending with "stop", is the grammar's doing.
"""

import re

import pytest
import xgrammar as xgr

from tests.tiny_checkpoints import tiny_model_with_tokenizer
from tinyserve import LLM, SamplingParams
from tinyserve.config import EngineArgs
from tinyserve.sampling_params import StructuredOutputsParams
from tinyserve.structured_output import GrammarError, check_structured_outputs, xgrammar_backend
from tinyserve.structured_output.lark import convert_lark_to_ebnf, grammar_is_likely_lark

# (a Lark grammar, the regex every output it allows must match)
GRAMMARS = [
    ('start: "a" ("b" | "c") "d"', r"a[bc]d"),
    ('// a comment\n?start: greeting  # another\ngreeting: "hi" "!"\n    | "yo" "?"\n', r"hi!|yo\?"),
    ('start: NUMBER "!"\nNUMBER: /[0-9]+/', None),  # unbounded: max_tokens ends it; checked as a prefix
    ('start: NUMBER "!"\nNUMBER: /[0-9]{1,3}/', r"[0-9]{1,3}!"),
    ('start: letter letter\nletter: "x".."z"', r"[x-z]{2}"),
    ('start: "<" [sign] DIGIT~1..2 ">"\nsign: "+" | "-"\nDIGIT: /[0-9]/', r"<[+-]?[0-9]{1,2}>"),
    ('start: answer\nanswer: "yes"\n      | "no"\n      | /maybe|perhaps/', r"yes|no|maybe|perhaps"),
]
LARK_READERS = ["xgrammar", "xgrammar-ebnf", "guidance"]  # xgrammar-ebnf: the converter; guidance: llguidance


@pytest.fixture(scope="module", params=LARK_READERS)
def llm(request):
    backend = "xgrammar" if request.param == "xgrammar-ebnf" else request.param
    if request.param == "xgrammar" and not xgrammar_backend.READS_LARK:
        pytest.skip("this xgrammar has no Grammar.from_lark (the converter's run covers it)")
    with pytest.MonkeyPatch.context() as patch:
        if request.param == "xgrammar-ebnf":
            patch.setattr(xgrammar_backend, "READS_LARK", False)  # as with xgrammar before 0.2
        yield LLM(str(tiny_model_with_tokenizer("llama")), num_kv_blocks=64, structured_outputs_backend=backend)


@pytest.mark.parametrize("grammar, language", GRAMMARS)
def test_a_lark_grammar_constrains_the_output_under_either_backend(llm, grammar, language):
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=3, n=3,
                            structured_outputs=StructuredOutputsParams(grammar=grammar))
    [output] = llm.generate("Say something", params, use_tqdm=False)
    for completion in output.outputs:
        if language is None:  # digits, then (had it ended) "!"
            assert re.fullmatch(r"[0-9]+!?", completion.text), completion.text
            continue
        assert re.fullmatch(language, completion.text), completion.text
        assert completion.finish_reason == "stop"  # the grammar was complete: only EOS could follow


def test_guidance_is_vllms_name_for_llguidance():
    assert EngineArgs(structured_outputs_backend="guidance").structured_outputs_backend == "guidance"
    args = EngineArgs.from_kwargs(structured_outputs_backend="guidance")
    assert args.structured_outputs_backend == "llguidance"


# ---- the converter --------------------------------------------------------------------------

def test_lark_is_told_from_ebnf():
    assert grammar_is_likely_lark('start: "a"')
    assert grammar_is_likely_lark('# a comment: with a colon\n?start: x\nx: "1"')
    assert not grammar_is_likely_lark('root ::= "a" | "b"')
    assert not grammar_is_likely_lark('root ::= item\nitem ::= "a:b"')  # a colon in an EBNF literal


@pytest.mark.parametrize("lark, ebnf", [
    ('start: "a" | "b"\n  | "c"', 'root ::= start\nstart ::= "a" | "b" | "c"\n'),  # multi-line alternatives
    ('// head\nstart: x  # tail\n\nx: "1" // end', 'root ::= start\nstart ::= x\nx ::= "1"\n'),  # comments
    ('root: x\nx: "1"', 'root ::= x\nx ::= "1"\n'),  # a root of its own is kept
    ('first: "q"', 'root ::= first\nfirst ::= "q"\n'),  # no start: the first rule, as vLLM does
    ('start: "//# not a comment"', 'root ::= start\nstart ::= "//# not a comment"\n'),
    ('?start.2: other\n!other: "k"', 'root ::= start\nstart ::= other\nother ::= "k"\n'),
    ("start: 'a' | 'it\\'s \"so\"'", 'root ::= start\nstart ::= "a" | "it\'s \\"so\\""\n'),  # single quotes
    ('start: "a".."f" "-" "0" .. "9"', 'root ::= start\nstart ::= [a-f] "-" [0-9]\n'),
    ('start: "a" [b c]\nb: "b"\nc: "c"', 'root ::= start\nstart ::= "a" (b c)?\nb ::= "b"\nc ::= "c"\n'),
    ('start: "a"~3 "b"~1..2', 'root ::= start\nstart ::= "a"{3} "b"{1,2}\n'),
])
def test_the_converter_writes_xgrammars_ebnf(lark, ebnf):
    assert convert_lark_to_ebnf(lark) == ebnf
    xgr.Grammar.from_ebnf(ebnf)  # and xgrammar reads it


def test_a_regex_terminal_becomes_rules_of_its_own_named_apart():
    ebnf = convert_lark_to_ebnf('start: A "/" B\nA: /[0-9]+/\nB: /x\\/y|\\d/')
    assert ebnf.startswith('root ::= start\nstart ::= A "/" B\nA ::= lark_regex_0\nB ::= lark_regex_1\n')
    names = [line.split(" ::= ")[0] for line in ebnf.splitlines()]
    assert len(names) == len(set(names)) and all(name.startswith("lark_regex_") for name in names[4:])
    xgr.Grammar.from_ebnf(ebnf)


ACCEPTS = {  # a grammar, and strings in and out of its language
    'start: "a" ("b" | "c") "d"': (["abd", "acd"], ["ad", "abcd", "abd "]),
    'start: NUMBER "!"\nNUMBER: /[0-9]{1,3}/': (["7!", "123!"], ["!", "1234!", "12"]),
    'start: "<" [sign] DIGIT~1..2 ">"\nsign: "+" | "-"\nDIGIT: /[0-9]/': (["<1>", "<-12>"], ["<>", "<+123>", "<s>"]),
    'start: word ("," word)*\nword: /[a-z]+/': (["a", "ab,c"], ["", "a,", ",a", "A"]),
    'start: /a.c/ | "x"~2': (["abc", "a-c", "xx"], ["ac", "x", "xxx"]),
}


@pytest.mark.parametrize("grammar", ACCEPTS)
def test_the_converted_grammar_has_the_language_of_the_lark_one(grammar):
    testing = pytest.importorskip("xgrammar.testing")
    accepts = getattr(testing, "_is_grammar_accept_string", None)
    if accepts is None:
        pytest.skip("this xgrammar has no xgrammar.testing._is_grammar_accept_string")
    converted = xgr.Grammar.from_ebnf(convert_lark_to_ebnf(grammar))
    readers = [converted] + ([xgr.Grammar.from_lark(grammar)] if xgrammar_backend.READS_LARK else [])
    inside, outside = ACCEPTS[grammar]
    for reader in readers:
        assert all(accepts(reader, text) for text in inside)
        assert not any(accepts(reader, text) for text in outside)


def test_an_ebnf_grammar_is_left_alone():
    ebnf = 'root ::= "a" item\nitem ::= [0-9]+ # a comment\n'
    params = StructuredOutputsParams(grammar=ebnf)
    assert str(xgrammar_backend._grammar(params)) == str(xgr.Grammar.from_ebnf(ebnf))


@pytest.mark.parametrize("grammar, words", [
    ('start: NUMBER\n%import common.NUMBER', "%import"),
    ('start: "a"\n%ignore " "', "%ignore"),
    ('start: /abc/i', "flags"),
    ('start: "abc"i', "case-insensitive"),
    ('| "a"', "before any rule"),
    ('start: "a', "unclosed literal"),
    ('start: /a', "unclosed regex"),
    ('start: /(/', "regex /\\(/ cannot be read"),
])
def test_what_ebnf_cannot_say_is_refused_naming_llguidance_or_the_line(grammar, words):
    with pytest.raises(GrammarError, match=re.escape(words) if "/" not in words else words):
        convert_lark_to_ebnf(grammar)


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_lark_directives_are_read_where_the_library_reads_lark(backend):
    if backend == "xgrammar" and not xgrammar_backend.READS_LARK:
        pytest.skip("this xgrammar has no Grammar.from_lark")
    params = StructuredOutputsParams(grammar='start: WORD (" " WORD)?\n%import common.WORD\n%ignore "\\t"')
    check_structured_outputs(params, backend)  # no GrammarError
