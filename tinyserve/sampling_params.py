"""SamplingParams: how to pick each next token, with vLLM's names and meanings.

It is a msgspec Struct so the same object can cross the process boundary to the
engine unchanged. Validation runs on construction, before anything is
scheduled, and every error names the parameter and the allowed range.
"""

import json

from typing import Any

import msgspec

from tinyserve.errors import InvalidInputError
from tinyserve.structured_output.schema_check import check_constraint_size, check_json_schema

_GREEDY_EPS = 1e-5  # temperatures below this mean greedy, as in vLLM
STRUCTURED_OUTPUT_KINDS = ("json", "regex", "choice", "grammar", "json_object")
# As vLLM's: bad words once tokenized (each spelling a sequence), so that the per-step check stays small
MAX_NUM_BAD_WORDS = 128
MAX_BAD_WORDS_TOTAL_TOKENS = 1024
MAX_LOGPROB_TOKEN_IDS = 128  # vLLM's bound on logprob_token_ids


class StructuredOutputsParams(msgspec.Struct, omit_defaults=True):
    """Constrain the output to a language (vLLM's names): exactly one of

    json          a JSON schema (a dict, or its text): the output is a JSON value it validates
    regex         a regular expression the whole output matches
    choice        a list of strings: the output is one of them
    grammar       a context-free grammar in EBNF (GBNF) notation
    json_object   True: the output is some JSON object

    The engine's grammar library (structured_output/) compiles it into a grammar whose
    token bitmask the sampler applies at every step; see engine/structured_output.py.
    """

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False

    def __post_init__(self) -> None:
        given = [kind for kind in STRUCTURED_OUTPUT_KINDS if getattr(self, kind) not in (None, False)]
        _check(len(given) == 1, "structured_outputs",
               f"must set exactly one of {', '.join(STRUCTURED_OUTPUT_KINDS)}, got {given or 'none'}")
        schema = self.json
        if isinstance(self.json, str):
            try:
                schema = json.loads(self.json)
            except ValueError as error:
                raise InvalidInputError(f"structured_outputs.json is not valid JSON: {error}", "structured_outputs") from None
            _check(isinstance(schema, (dict, bool)), "structured_outputs.json", "must be a JSON schema object")
        if schema is not None:
            check_json_schema(schema, "structured_outputs")
        _check(self.choice is None or (isinstance(self.choice, list) and self.choice
                                       and all(isinstance(c, str) and c for c in self.choice)),
               "structured_outputs.choice", f"must be a non-empty list of non-empty strings, got {self.choice!r}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            _check(value is None or (isinstance(value, str) and value), f"structured_outputs.{name}",
                   "must be a non-empty string")
        for name in ("regex", "grammar", "choice"):
            if getattr(self, name) is not None:
                check_constraint_size(name, getattr(self, name), "structured_outputs")
        _check(isinstance(self.json_object, bool), "structured_outputs.json_object", "must be true or false")

    @property
    def kind(self) -> str:
        return next(kind for kind in STRUCTURED_OUTPUT_KINDS if getattr(self, kind) not in (None, False))

    @property
    def spec(self) -> str:
        """The constraint as one string, the key of the compiled-grammar cache."""
        value = getattr(self, self.kind)
        return value if isinstance(value, str) else json.dumps(value, sort_keys=True)


class SamplingParams(msgspec.Struct, omit_defaults=True):
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: all tokens
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs to return besides the sampled token's
    # vLLM's: with logprobs, these tokens' logprobs at each position instead of the top ones (the sampled
    # token's still first), for scoring a fixed set of labels
    logprob_token_ids: list[int] | None = None
    prompt_logprobs: int | None = None  # the same for every prompt token after the first
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit before sampling
    allowed_token_ids: list[int] | None = None  # only these may be sampled
    bad_words: list[str] | None = None  # words the output must not contain (see update_from_tokenizer)
    structured_outputs: StructuredOutputsParams | None = None  # a grammar the output must follow
    # vLLM's: arguments for layers beside the sampler; "kv_transfer_params" alone (distributed/kv_transfer/)
    extra_args: dict[str, Any] | None = None
    # bad_words as token ids, filled by update_from_tokenizer before the request reaches the engine
    _bad_words_token_ids: list[list[int]] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self._check_types()
        _check(isinstance(self.n, int) and self.n >= 1, "n", f"must be at least 1, got {self.n}")
        _check(self.temperature >= 0, "temperature", f"must be non-negative, got {self.temperature}")
        _check(0 < self.top_p <= 1, "top_p", f"must be in (0, 1], got {self.top_p}")
        _check(-1 <= self.top_k < 2**31, "top_k", f"must be -1 or 0 (disable) or in [1, 2**31), got {self.top_k}")
        _check(0 <= self.min_p <= 1, "min_p", f"must be in [0, 1], got {self.min_p}")
        _check(self.max_tokens is None or self.max_tokens >= 1, "max_tokens", f"must be at least 1, got {self.max_tokens}")
        _check(self.min_tokens >= 0, "min_tokens", f"must be non-negative, got {self.min_tokens}")
        if self.max_tokens is not None:
            _check(self.min_tokens <= self.max_tokens, "min_tokens", f"must not exceed max_tokens={self.max_tokens}, got {self.min_tokens}")
        _check(self.logprobs is None or self.logprobs >= -1, "logprobs",
               f"must be non-negative, or -1 for the whole vocabulary, got {self.logprobs}")
        _check(self.prompt_logprobs is None or self.prompt_logprobs >= -1, "prompt_logprobs",
               f"must be non-negative, or -1 for the whole vocabulary, got {self.prompt_logprobs}")
        _check(-2 <= self.presence_penalty <= 2, "presence_penalty", f"must be in [-2, 2], got {self.presence_penalty}")
        _check(-2 <= self.frequency_penalty <= 2, "frequency_penalty", f"must be in [-2, 2], got {self.frequency_penalty}")
        _check(0 < self.repetition_penalty, "repetition_penalty", f"must be positive, got {self.repetition_penalty}")
        _check(not self.stop or all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings")
        _check(self.seed is None or -(2**63) <= self.seed < 2**63, "seed", f"must fit in 64 bits, got {self.seed}")
        if self.logit_bias:
            bad = [(t, b) for t, b in self.logit_bias.items() if not -100 <= b <= 100]
            _check(not bad, "logit_bias", f"values must be in [-100, 100], got {bad[:3]}")
        _check(self.allowed_token_ids is None or len(self.allowed_token_ids) > 0, "allowed_token_ids",
               "must not be empty: no token could be sampled")

    def _check_types(self) -> None:
        """Wrong types fail here, naming the parameter, rather than later inside an engine step."""
        for name in ("n", "top_k", "min_tokens"):
            _check(_is_int(getattr(self, name)), name, f"must be an integer, got {getattr(self, name)!r}")
        for name in ("max_tokens", "logprobs", "prompt_logprobs", "seed"):
            value = getattr(self, name)
            _check(value is None or _is_int(value), name, f"must be an integer or None, got {value!r}")
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            _check(_is_number(getattr(self, name)), name, f"must be a number, got {getattr(self, name)!r}")
        _check(self.stop is None or isinstance(self.stop, list), "stop",
               f"must be a string or a list of strings, got {self.stop!r}")
        _check(self.stop_token_ids is None
               or (isinstance(self.stop_token_ids, list) and all(map(_is_int, self.stop_token_ids))),
               "stop_token_ids", f"must be a list of token ids, got {self.stop_token_ids!r}")
        _check(self.logit_bias is None or (isinstance(self.logit_bias, dict) and all(map(_is_int, self.logit_bias))
                                           and all(map(_is_number, self.logit_bias.values()))),
               "logit_bias", f"must map token ids to numbers, got {self.logit_bias!r}")
        _check(self.allowed_token_ids is None
               or (isinstance(self.allowed_token_ids, list) and all(map(_is_int, self.allowed_token_ids))),
               "allowed_token_ids", f"must be a list of token ids, got {_short(self.allowed_token_ids)}")
        _check(self.logprob_token_ids is None
               or (isinstance(self.logprob_token_ids, list) and all(map(_is_int, self.logprob_token_ids))),
               "logprob_token_ids", f"must be a list of token ids, got {_short(self.logprob_token_ids)}")
        if self.logprob_token_ids is not None:
            _check(len(self.logprob_token_ids) <= MAX_LOGPROB_TOKEN_IDS, "logprob_token_ids",
                   f"has {len(self.logprob_token_ids)} ids, more than the limit of {MAX_LOGPROB_TOKEN_IDS}")
        _check(self.bad_words is None
               or (isinstance(self.bad_words, list) and all(isinstance(word, str) for word in self.bad_words)),
               "bad_words", f"must be a list of strings, got {_short(self.bad_words)}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def bad_words_token_ids(self) -> list[list[int]] | None:
        """Each bad word as token ids, once update_from_tokenizer has run (vLLM's name)."""
        return self._bad_words_token_ids

    def update_from_tokenizer(self, tokenizer) -> None:
        """Tokenize bad_words as vLLM does: each word with its leading spaces stripped, then again after
        one space (the word inside a text), that second spelling kept when it starts with another token
        and has as many:

            "ugly"    -> [ugly], and [Ġugly] from " ugly"     each banned
            "Zen of"  -> [Zen, Ġof]                          Ġof banned right after Zen

        The sampler bans a sequence's last token whenever the output ends with the tokens before
        it (engine/worker/token_filters.py). Token ids outside the vocabulary are the input
        processor's to refuse.
        """
        if not self.bad_words:
            return
        token_ids = []
        for word in self.bad_words:
            plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
            _check(len(plain) > 0, "bad_words", f"entries must be at least one token, got {word!r}")
            token_ids.append(plain)
            spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
                token_ids.append(spaced)
        _check(len(token_ids) <= MAX_NUM_BAD_WORDS, "bad_words",
               f"are {len(token_ids)} token sequences once tokenized, more than the limit of {MAX_NUM_BAD_WORDS}")
        num_tokens = sum(map(len, token_ids))
        _check(num_tokens <= MAX_BAD_WORDS_TOTAL_TOKENS, "bad_words",
               f"are {num_tokens} tokens once tokenized, more than the limit of {MAX_BAD_WORDS_TOTAL_TOKENS}")
        self._bad_words_token_ids = token_ids

    def clone(self, **changes) -> "SamplingParams":
        return msgspec.structs.replace(self, **changes)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _short(value) -> str:
    """A value for an error message: its repr, cut short (a list may hold a whole vocabulary)."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _check(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise InvalidInputError(f"{name} {message}", name.split(".")[0])
