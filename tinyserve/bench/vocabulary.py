"""Which token ids `bench serve` may put in a prompt, and how to turn ids into chat text.

The random dataset draws token ids from the server's vocabulary, so the benchmark needs
the server model's tokenizer. It takes the first of:

1. `--tokenizer PATH`: a local model folder (or any folder with tokenizer files);
2. the `--model` name, when it is a local folder with tokenizer files;
3. the folder the server reports as the model's "root" in /v1/models (tinyserve does),
   when it exists on this machine;
4. the server itself, through tinyserve's /tokenize and /detokenize: a seeded random
   text is tokenized, and the distinct ids that come back are the pool (no special
   token can appear in them, since the text is plain).
"""

import pathlib
from collections.abc import Callable
from dataclasses import dataclass

import httpx
import numpy as np

from tinyserve.bench.datasets import vocabulary_pool
from tinyserve.models.tokenizer import TOKENIZER_FILES, load_tokenizer

# The plain text that probes a remote vocabulary: random lowercase words (and some
# capitalized, some with punctuation), enough for a few thousand distinct ids.
_PROBE_WORDS = 6000
_PROBE_LETTERS = "abcdefghijklmnopqrstuvwxyz"


@dataclass(slots=True)
class PromptVocabulary:
    token_pool: list[int]
    decode: Callable[[list[int]], str]
    encode: Callable[[str], list[int]]  # no special tokens added
    source: str  # where it came from, for the report


def has_tokenizer(path: str | None) -> bool:
    return path is not None and any((pathlib.Path(path) / name).is_file() for name in TOKENIZER_FILES)


def local_vocabulary(path: str) -> PromptVocabulary:
    tokenizer = load_tokenizer(path)
    pool = vocabulary_pool(len(tokenizer), tokenizer.all_special_ids)
    return PromptVocabulary(pool, lambda ids: tokenizer.decode(ids),
                            lambda text: tokenizer.encode(text, add_special_tokens=False), f"tokenizer files in {path}")


def _probe_text(seed: int) -> str:
    rng = np.random.default_rng(seed)
    words = []
    for _ in range(_PROBE_WORDS):
        word = "".join(rng.choice(list(_PROBE_LETTERS), size=int(rng.integers(1, 9))))
        if rng.random() < 0.1:
            word = word.capitalize()
        if rng.random() < 0.1:
            word += str(rng.choice(list(".,;:!?")))
        words.append(word)
    return " ".join(words)


def server_vocabulary(client: httpx.Client, base_url: str, model: str, seed: int) -> PromptVocabulary:
    """The pool and decoder of a tinyserve server, through /tokenize and /detokenize."""
    def encode(text: str) -> list[int]:
        answer = client.post(f"{base_url}/tokenize", json={"model": model, "prompt": text, "add_special_tokens": False})
        if answer.status_code != 200:
            raise ValueError(f"no local tokenizer for {model!r} and {base_url}/tokenize answered "
                             f"{answer.status_code}; pass --tokenizer PATH")
        return answer.json()["tokens"]

    def decode(ids: list[int]) -> str:
        answer = client.post(f"{base_url}/detokenize", json={"model": model, "tokens": ids})
        if answer.status_code != 200:
            raise ValueError(f"{base_url}/detokenize answered {answer.status_code}: {answer.text[:200]}")
        return answer.json()["prompt"]

    pool = sorted(set(encode(_probe_text(seed))))
    return PromptVocabulary(pool, decode, encode, f"{base_url}/tokenize and /detokenize")


def resolve_vocabulary(client: httpx.Client, base_url: str, model: str, tokenizer: str | None,
                       model_root: str | None, seed: int) -> PromptVocabulary:
    if tokenizer is not None:
        if not has_tokenizer(tokenizer):
            raise ValueError(f"tokenizer {tokenizer!r} is not a folder with tokenizer files "
                             f"({', '.join(TOKENIZER_FILES)})")
        return local_vocabulary(tokenizer)
    for candidate in (model, model_root):
        if has_tokenizer(candidate):
            return local_vocabulary(candidate)
    return server_vocabulary(client, base_url, model, seed)
