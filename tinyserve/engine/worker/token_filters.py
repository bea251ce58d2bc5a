"""allowed_token_ids and bad_words: the tokens a request forbids, masked with -inf before sampling (vLLM's).

The sampler calls `apply_token_filters` on each request's row first, before min_tokens
and logit_bias (sampler.py), the order of vLLM's v1 sampler:

    allowed_token_ids [5, 9]      every other token gets -inf
    bad_words [[12], [30, 31]]    12 always; 31 whenever the output so far ends with 30

A bad word's token ids come from SamplingParams.update_from_tokenizer, which the input
processor runs. Only the output is matched, never the prompt, as in vLLM: a bad word
split between prompt and output is not caught.
"""

import torch

from tinyserve.engine.worker.request_state import CachedRequestState


def apply_token_filters(logits: torch.Tensor, request: CachedRequestState) -> None:
    """In place, on one request's row of logits [vocab]."""
    params = request.sampling_params
    if params.allowed_token_ids is not None:
        apply_allowed_token_ids(logits, request)
    if params.bad_words_token_ids:
        apply_bad_words(logits, params.bad_words_token_ids, request.output_token_ids)


def apply_allowed_token_ids(logits: torch.Tensor, request: CachedRequestState) -> None:
    """-inf for every token outside allowed_token_ids. The mask (True: forbidden, vLLM's
    allowed_token_ids_mask) is made at the request's first step and kept with it."""
    mask = request.allowed_token_ids_mask
    if mask is None:
        mask = torch.ones(logits.shape[-1], dtype=torch.bool, device=logits.device)
        mask[torch.tensor(request.sampling_params.allowed_token_ids, device=logits.device)] = False
        request.allowed_token_ids_mask = mask
    logits.masked_fill_(mask, float("-inf"))


def apply_bad_words(logits: torch.Tensor, bad_words_token_ids: list[list[int]], output_token_ids: list[int]) -> None:
    """-inf for each bad word's last token when the output ends with the word's other tokens."""
    banned = []
    for word in bad_words_token_ids:
        *prefix, last = word
        if len(prefix) > len(output_token_ids):
            continue
        if not prefix or output_token_ids[-len(prefix):] == prefix:
            banned.append(last)
    if banned:
        logits[banned] = float("-inf")
