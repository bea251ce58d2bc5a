"""--speculative-config: vLLM's fields, checked at start-up, each error naming its field.

    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    {"method": "draft_model", "model": PATH, "num_speculative_tokens": 3}
    {"method": "draft_model", "num_speculative_tokens": 3}      the built-in draft (default_draft_path)
"""

import json
from dataclasses import dataclass
from pathlib import Path

METHODS = ("ngram", "draft_model")
FIELDS = {
    "ngram": {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"},
    "draft_model": {"method", "num_speculative_tokens", "model"},
}


@dataclass(slots=True, frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int = 0  # ngram: the longest suffix looked up in the request's own tokens
    prompt_lookup_min: int = 0  # ngram: the shortest
    model: str | None = None  # draft_model: the draft's folder or hub id

    @classmethod
    def from_dict(cls, config: dict) -> "SpeculativeConfig":
        if not isinstance(config, dict):
            raise ValueError(f"speculative_config must be a JSON object, got {config!r}")
        method = config.get("method")
        if method is None and config.get("model") is not None:
            method = "draft_model"  # vLLM's reading of a config that names a model only
        if method not in METHODS:
            raise ValueError(f"speculative_config.method must be one of {list(METHODS)}, got {method!r}")
        unknown = sorted(set(config) - FIELDS[method])
        if unknown:
            raise ValueError(f"speculative_config: field(s) {unknown} do not apply to method {method!r}; "
                             f"its fields are {sorted(FIELDS[method])}")
        num = config.get("num_speculative_tokens")
        if not isinstance(num, int) or isinstance(num, bool) or num < 1:
            raise ValueError(f"speculative_config.num_speculative_tokens must be an integer of at least 1, got {num!r}")
        if method == "ngram":
            lookup_max = config.get("prompt_lookup_max", config.get("prompt_lookup_min", 5))
            lookup_min = config.get("prompt_lookup_min", min(lookup_max, 5) if isinstance(lookup_max, int) else 1)
            for name, value in (("prompt_lookup_max", lookup_max), ("prompt_lookup_min", lookup_min)):
                if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                    raise ValueError(f"speculative_config.{name} must be an integer of at least 1, got {value!r}")
            if lookup_min > lookup_max:
                raise ValueError(f"speculative_config.prompt_lookup_min ({lookup_min}) must not exceed "
                                 f"prompt_lookup_max ({lookup_max})")
            return cls(method, num, prompt_lookup_max=lookup_max, prompt_lookup_min=lookup_min)
        model = config.get("model")
        if model is not None and not isinstance(model, str):
            raise ValueError(f"speculative_config.model must be a path or model id, got {model!r}")
        return cls(method, num, model=model)

    def draft_path(self) -> Path:
        """The draft model's folder: `model`, or the built-in draft."""
        from tinyserve.models.loader import resolve_model_path

        if self.model is not None:
            return resolve_model_path(self.model)
        try:
            from tinyserve.models.default_model import default_draft_path
            return default_draft_path()
        except (ImportError, FileNotFoundError) as error:
            raise ValueError("speculative_config: method 'draft_model' needs 'model' (a draft checkpoint sharing "
                             f"the target's vocabulary): no built-in draft is installed ({error})") from None


def parse_speculative_config(text: str) -> dict:
    """--speculative-config's JSON text, as a dict (checked further by SpeculativeConfig.from_dict)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"--speculative-config is not valid JSON: {error}") from None
    SpeculativeConfig.from_dict(value)
    return value


def check_draft_vocabulary(draft: Path, target_vocab_size: int) -> None:
    """A draft must speak the target's vocabulary: its tokens are the target's drafts."""
    config = json.loads((draft / "config.json").read_text())
    if config.get("vocab_size") != target_vocab_size:
        raise ValueError(f"speculative_config.model: the draft {draft} has vocab_size {config.get('vocab_size')}, "
                         f"the target {target_vocab_size}; a draft must share the target's vocabulary")
