"""The xgrammar backend (the default): compile once per constraint, then one matcher per request.

xgrammar splits the work in two. `GrammarCompiler.compile_*` turns a constraint into a
CompiledGrammar for one vocabulary: a pushdown automaton plus, for each of its states, the
tokens that are accepted or rejected whatever the stack holds (most of them), so that
filling a mask at run time only has to check the few context-dependent tokens. That is the
expensive part (milliseconds to seconds), done once per distinct constraint and cached. A
`GrammarMatcher` is the cheap per-request part: the automaton's current state, advanced
by `accept_token` and asked for the next mask by `fill_next_token_bitmask`.
"""

import json
import re

import xgrammar as xgr

from tinyserve.structured_output import GrammarError, choice_as_ebnf
from tinyserve.structured_output.lark import convert_lark_to_ebnf, grammar_is_likely_lark

READS_LARK = hasattr(xgr.Grammar, "from_lark")  # xgrammar >= 0.2: Grammar.from_lark


def check(params) -> None:
    """Build the grammar without a vocabulary: what the library cannot parse fails here."""
    try:
        _grammar(params)
    except Exception as error:  # xgrammar raises RuntimeError, ValueError or its own types
        raise _error(params, error) from None


def _error(params, error: Exception) -> GrammarError:
    # xgrammar's messages start with a time and a C++ source position: "[14:03:42] /project/cpp/x.cc:94: ..."
    message = re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", str(error).strip())
    return GrammarError(f"structured_outputs.{params.kind} cannot be compiled by xgrammar: {message}")


def _grammar(params) -> "xgr.Grammar":
    kind = params.kind
    if kind == "json":
        return xgr.Grammar.from_json_schema(_schema_text(params.json), any_whitespace=False)
    if kind == "json_object":  # an object, as OpenAI's json_object means (xgrammar's builtin JSON takes arrays too)
        return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False)
    if kind == "regex":
        return xgr.Grammar.from_regex(params.regex)
    if kind == "choice":
        return xgr.Grammar.from_ebnf(choice_as_ebnf(params.choice))
    grammar = params.grammar
    if grammar_is_likely_lark(grammar):  # vLLM takes Lark too
        if READS_LARK:  # xgrammar 0.2 reads it itself, as llguidance does: %import common, %ignore and all
            return xgr.Grammar.from_lark(grammar)
        grammar = convert_lark_to_ebnf(grammar)  # an older one reads its EBNF form (lark.py)
    return xgr.Grammar.from_ebnf(grammar)


def _schema_text(schema) -> str:
    return schema if isinstance(schema, str) else json.dumps(schema)


class Compiler:
    """Compiles constraints for one vocabulary (the tokenizer's tokens, padded to the model's vocab_size)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int]) -> None:
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=eos_token_ids)
        # Compiles run in the manager's threads; xgrammar's own cache is off, the manager keeps one.
        self.compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    def compile(self, params) -> "Grammar":
        try:
            compiled = self.compiler.compile_grammar(_grammar(params))
        except Exception as error:
            raise _error(params, error) from None
        return compiled

    @staticmethod
    def matcher(compiled) -> "Grammar":
        return Grammar(xgr.GrammarMatcher(compiled))


class Grammar:
    """One request's place in its grammar."""

    def __init__(self, matcher: "xgr.GrammarMatcher") -> None:
        self.matcher = matcher

    def accept(self, token_id: int) -> bool:
        return self.matcher.accept_token(token_id)

    def fill_bitmask(self, bitmask, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)

    @property
    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()
