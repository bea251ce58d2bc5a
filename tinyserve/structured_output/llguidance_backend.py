"""The llguidance backend: an Earley parser over a lexer, masks computed on the fly.

llguidance compiles next to nothing ahead of time: `LLMatcher` parses the constraint (a
JSON schema, a regex, a Lark or GBNF grammar) when it is made, and computes each step's
mask from the parser's current state, walking the vocabulary as a token trie. So the
"compiled" form kept in the cache is the grammar text it understands, and each request
gets its own matcher over it.
"""

import json

import llguidance
import llguidance.hf
import llguidance.torch

from tinyserve.structured_output import GrammarError, choice_as_ebnf
from tinyserve.structured_output.lark import grammar_is_likely_lark


def _grammar_text(params) -> str:
    kind = params.kind
    if kind in ("json", "json_object"):
        schema = {"type": "object"} if kind == "json_object" else params.json
        schema = json.loads(schema) if isinstance(schema, str) else schema
        if isinstance(schema, dict):  # compact JSON, as the xgrammar backend writes it: no run of whitespace
            schema = {**schema, "x-guidance": {"whitespace_flexible": False, **schema.get("x-guidance", {})}}
        return llguidance.grammar_from("json_schema", json.dumps(schema))
    if kind == "regex":
        return llguidance.grammar_from("regex", params.regex)
    if kind == "choice":
        return llguidance.grammar_from("grammar", choice_as_ebnf(params.choice))
    # Lark or EBNF: said, not guessed by llguidance (whose guess takes a Lark grammar opening with a comment for EBNF)
    return llguidance.grammar_from("lark" if grammar_is_likely_lark(params.grammar) else "grammar", params.grammar)


def check(params) -> None:
    try:
        problem = llguidance.LLMatcher.validate_grammar(_grammar_text(params))
    except Exception as error:
        problem = str(error)
    if problem:
        raise GrammarError(f"structured_outputs.{params.kind} cannot be compiled by llguidance: {problem}")


class Compiler:
    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int]) -> None:
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size,
                                                      eos_token=eos_token_ids[:1] or None)

    def compile(self, params) -> str:
        check(params)
        return _grammar_text(params)

    def matcher(self, grammar_text: str) -> "Grammar":
        matcher = llguidance.LLMatcher(self.tokenizer, grammar_text)
        if matcher.is_error():
            raise GrammarError(f"structured_outputs cannot be compiled by llguidance: {matcher.get_error()}")
        return Grammar(matcher)


class Grammar:
    def __init__(self, matcher: "llguidance.LLMatcher") -> None:
        self.matcher = matcher

    def accept(self, token_id: int) -> bool:
        return self.matcher.consume_token(token_id)

    def fill_bitmask(self, bitmask, row: int) -> None:
        llguidance.torch.fill_next_token_bitmask(self.matcher, bitmask, row)

    @property
    def is_terminated(self) -> bool:
        return self.matcher.is_stopped()
