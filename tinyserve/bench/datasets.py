"""The random dataset: prompts of random token ids, with lengths spread around a mean.

As vLLM's random dataset: each request's input and output lengths are drawn uniformly
from the integers in [L·(1−r), L·(1+r)] (L the mean, r the range ratio), and its prompt
is that many token ids drawn uniformly from a pool: the vocabulary without its special
tokens (a random <|im_end|> or <|end_of_text|> inside a prompt would change what the
model is asked to do). Everything comes from one seeded generator, so a seed gives the
same requests on every run.

    requests = random_requests(num_prompts=32, input_len=128, output_len=64, range_ratio=0.5,
                               token_pool=vocabulary_pool(4096, tokenizer.all_special_ids), seed=0)
"""

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(slots=True)
class SampleRequest:
    prompt: list[int] | str  # token ids, or their decoded text (for chat messages)
    prompt_len: int  # tokens in the dataset's prompt (a chat template adds more on the server)
    expected_output_len: int  # max_tokens of the request


def check_dataset_args(num_prompts: int, input_len: int, output_len: int, range_ratio: float) -> None:
    if num_prompts < 1:
        raise ValueError(f"num_prompts must be at least 1, got {num_prompts}")
    if input_len < 1:
        raise ValueError(f"input_len must be at least 1, got {input_len}")
    if output_len < 1:
        raise ValueError(f"output_len must be at least 1, got {output_len}")
    if not 0 <= range_ratio < 1:
        raise ValueError(f"range_ratio must be in [0, 1), got {range_ratio}")


def length_range(mean: int, range_ratio: float) -> tuple[int, int]:
    """The smallest and largest length a request may get (inclusive, at least 1)."""
    low = max(1, math.floor(mean * (1 - range_ratio)))
    high = max(low, math.ceil(mean * (1 + range_ratio)))
    return low, high


def vocabulary_pool(vocab_size: int, special_ids: Iterable[int]) -> list[int]:
    """Every token id below vocab_size except the special ones."""
    special = set(special_ids)
    pool = [token_id for token_id in range(vocab_size) if token_id not in special]
    if not pool:
        raise ValueError(f"the vocabulary of {vocab_size} ids has only special tokens; no prompt can be drawn from it")
    return pool


def random_requests(num_prompts: int, input_len: int, output_len: int, range_ratio: float,
                    token_pool: Sequence[int], seed: int) -> list[SampleRequest]:
    check_dataset_args(num_prompts, input_len, output_len, range_ratio)
    if not token_pool:
        raise ValueError("token_pool must not be empty")
    rng = np.random.default_rng(seed)
    input_low, input_high = length_range(input_len, range_ratio)
    output_low, output_high = length_range(output_len, range_ratio)
    input_lens = rng.integers(input_low, input_high + 1, size=num_prompts)
    output_lens = rng.integers(output_low, output_high + 1, size=num_prompts)
    pool = np.asarray(token_pool)
    requests = []
    for prompt_len, expected_output_len in zip(input_lens.tolist(), output_lens.tolist()):
        prompt = pool[rng.integers(0, len(pool), size=prompt_len)].tolist()
        requests.append(SampleRequest(prompt, prompt_len, expected_output_len))
    return requests


def text_of_length(token_ids: list[int], decode: Callable[[list[int]], str], encode: Callable[[str], list[int]],
                   max_rounds: int = 8) -> str:
    """Text that encodes back to as many tokens as `token_ids` (or close, after max_rounds).

    Random ids rarely survive decode → encode: a lone byte of a multi-byte character
    decodes to U+FFFD, which encodes as three bytes. As vLLM does, re-encode the text,
    cut or extend the ids to the length wanted, decode again, until it holds.
    """
    target = len(token_ids)
    ids = token_ids
    text = decode(ids)
    for _ in range(max_rounds):
        ids = encode(text)
        if len(ids) == target:
            break
        ids = ids[:target] if len(ids) > target else ids + token_ids[: target - len(ids)]
        text = decode(ids)
    return text


def as_text_prompts(requests: list[SampleRequest], decode: Callable[[list[int]], str],
                    encode: Callable[[str], list[int]]) -> list[SampleRequest]:
    """The same requests with each prompt as text of about its length (chat messages carry text, not ids)."""
    return [SampleRequest(text_of_length(r.prompt, decode, encode), r.prompt_len, r.expected_output_len)
            for r in requests]
