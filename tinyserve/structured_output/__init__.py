"""Structured outputs: the grammar libraries behind `SamplingParams.structured_outputs`.

A grammar library does the hard part for us. Given a JSON schema, a regex, a list of
choices or an EBNF grammar, and the model's vocabulary, it builds an automaton over
tokens (not characters: one token may cover several grammar symbols, or end half-way
through one) and answers, at each position, "which token ids may come next?" as a
bitmask of 32-bit words, one bit per vocabulary id. The sampler sets the logits of
the forbidden ids to -inf, so whatever the model prefers, the output stays in the
language; when the language allows the output to end, the EOS token is allowed, and
when nothing else may follow, it is the only one allowed.

Two libraries, chosen with --structured-outputs-backend, behind one interface: each
backend module has `check(params)`, a `Compiler(tokenizer, vocab_size, eos_token_ids)`
whose `compile(params)` result is cached and whose `matcher(compiled)` is one request's
`Grammar` (`accept(token_id)`, `fill_bitmask(bitmask, row)`, `is_terminated`).

    xgrammar     (default)  precomputes, per grammar, the tokens that are valid whatever
                            the stack holds, so most of a step's mask is a table lookup
    llguidance              an Earley parser over a lexer, computes masks on the fly:
                            no compile time to speak of, and full Lark/GBNF grammars

Both are imported only when used. The API process calls `check` (no vocabulary needed)
to refuse a schema the library cannot handle with a 400 before the request is sent;
the engine compiles (`Compiler.compile`) in its own threads (engine/structured_output.py).
"""

import importlib

from tinyserve.errors import InvalidInputError

STRUCTURED_OUTPUT_BACKENDS = ("xgrammar", "llguidance")
BACKEND_ALIASES = {"guidance": "llguidance"}  # vLLM's name for the llguidance backend


class GrammarError(InvalidInputError):
    """A constraint the grammar library cannot compile; the message names the problem (a 400 at the API)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, "structured_outputs")


def compile_deadline_error(timeout_s: float) -> GrammarError:
    """A constraint not checked and compiled within --structured-outputs-compile-timeout of the request's arrival
    (the front end's check, then the engine's compile: input_processor.py, engine/structured_output.py)."""
    return GrammarError(f"structured_outputs: the constraint was not compiled within {timeout_s:g} s "
                        "(--structured-outputs-compile-timeout); a smaller schema or grammar compiles faster")


def get_backend_module(name: str):
    """The module of backend `name`; a clear error if it is unknown or its library is not installed."""
    if name not in STRUCTURED_OUTPUT_BACKENDS:
        raise ValueError(f"structured_outputs_backend must be one of {STRUCTURED_OUTPUT_BACKENDS}, got {name!r}")
    try:
        importlib.import_module(name)
    except ImportError as error:
        raise ValueError(f"structured_outputs_backend {name!r} needs the {name} package, which is not installed "
                         f"(pip install {name}): {error}") from None
    return importlib.import_module(f"tinyserve.structured_output.{name}_backend")


_checked: set[tuple[str, str, bytes]] = set()  # constraints that passed: (backend, kind, digest of the spec)
_MAX_CHECKED = 1024


def check_structured_outputs(params, backend: str) -> None:
    """Raise GrammarError if `backend` cannot compile the StructuredOutputsParams `params`.

    One that passed is remembered (up to _MAX_CHECKED of them, by a 32-byte digest, so that
    huge schemas cost no memory here), so a schema sent with every request is parsed once."""
    import hashlib

    key = (backend, params.kind, hashlib.sha256(params.spec.encode()).digest())
    if key in _checked:
        return
    get_backend_module(backend).check(params)
    if len(_checked) >= _MAX_CHECKED:
        _checked.clear()
    _checked.add(key)


def choice_as_ebnf(choices: list[str]) -> str:
    """`choice` as a grammar: one alternative per string, each a JSON-escaped literal (vLLM's way)."""
    import json

    return "root ::= " + " | ".join(json.dumps(choice) for choice in choices)
