"""SamplingParams: how to pick each next token, with vLLM's names and meanings.

It is a msgspec Struct so the same object can cross the process boundary to the
engine unchanged. Validation runs on construction, before anything is
scheduled, and every error names the parameter and the allowed range.
"""

import msgspec

_GREEDY_EPS = 1e-5  # temperatures below this mean greedy, as in vLLM


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
    prompt_logprobs: int | None = None  # the same for every prompt token after the first
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit before sampling

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        _check(isinstance(self.n, int) and self.n >= 1, "n", f"must be at least 1, got {self.n}")
        _check(self.temperature >= 0, "temperature", f"must be non-negative, got {self.temperature}")
        _check(0 < self.top_p <= 1, "top_p", f"must be in (0, 1], got {self.top_p}")
        _check(-1 <= self.top_k < 2**31, "top_k", f"must be -1 or 0 (disable) or in [1, 2**31), got {self.top_k}")
        _check(0 <= self.min_p <= 1, "min_p", f"must be in [0, 1], got {self.min_p}")
        _check(self.max_tokens is None or self.max_tokens >= 1, "max_tokens", f"must be at least 1, got {self.max_tokens}")
        _check(self.min_tokens >= 0, "min_tokens", f"must be non-negative, got {self.min_tokens}")
        if self.max_tokens is not None:
            _check(self.min_tokens <= self.max_tokens, "min_tokens", f"must not exceed max_tokens={self.max_tokens}, got {self.min_tokens}")
        _check(self.logprobs is None or self.logprobs >= 0, "logprobs", f"must be non-negative, got {self.logprobs}")
        _check(self.prompt_logprobs is None or self.prompt_logprobs >= 0, "prompt_logprobs",
               f"must be non-negative, got {self.prompt_logprobs}")
        _check(-2 <= self.presence_penalty <= 2, "presence_penalty", f"must be in [-2, 2], got {self.presence_penalty}")
        _check(-2 <= self.frequency_penalty <= 2, "frequency_penalty", f"must be in [-2, 2], got {self.frequency_penalty}")
        _check(0 < self.repetition_penalty <= 2, "repetition_penalty", f"must be in (0, 2], got {self.repetition_penalty}")
        _check(not self.stop or all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings")
        _check(self.seed is None or -(2**63) <= self.seed < 2**63, "seed", f"must fit in 64 bits, got {self.seed}")
        if self.logit_bias:
            bad = [(t, b) for t, b in self.logit_bias.items() if not -100 <= b <= 100]
            _check(not bad, "logit_bias", f"values must be in [-100, 100], got {bad[:3]}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    def clone(self, **changes) -> "SamplingParams":
        return msgspec.structs.replace(self, **changes)


def _check(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{name} {message}")
