"""vLLM's truncate_prompt_tokens and truncation_side (completions, chat, embeddings, pooling), as a
render.Truncation.

    truncate_prompt_tokens   N: a prompt longer than N tokens keeps N of them; -1: as many as the context
                             takes (max_model_len - 1 when generating, a token left for the output;
                             max_model_len for an embedding); more than max_model_len: a 400
    truncation_side          "left" keeps the last N tokens, "right" the first N; left out: vLLM's default,
                             "left" when generating, "right" for embeddings

A chat's prompt is the conversation as the chat template renders it: its token ids are truncated, as a
completion's are, so the template's own opening may be what is cut. When a completion's or a chat's
prompt is truncated, max_tokens is capped to what the context leaves after it, as vLLM caps it (its
get_max_tokens), rather than refused (fitted_max_tokens).
"""

from tinyserve.entrypoints.api.errors import APIError
from tinyserve.frontend.render import Truncation


def prompt_truncation(truncate_prompt_tokens: int | None, truncation_side: str | None, max_model_len: int,
                      pooling: bool = False) -> Truncation | None:
    if truncate_prompt_tokens is None:
        return None
    if truncate_prompt_tokens > max_model_len:
        message = ("truncate_prompt_tokens value is greater than max_model_len. Please request a smaller truncation "
                   "size." if pooling else
                   f"truncate_prompt_tokens={truncate_prompt_tokens} cannot be greater than max_model_len = "
                   f"{max_model_len}. Please request a smaller truncation size.")
        raise APIError(400, message, "truncate_prompt_tokens")
    keep = truncate_prompt_tokens
    if keep == -1:
        keep = max_model_len if pooling else max_model_len - 1
    return Truncation(keep, truncation_side or ("right" if pooling else "left"))


def fitted_max_tokens(requested: int | None, num_prompt_tokens: int, max_model_len: int) -> int | None:
    """A truncated prompt's max_tokens: at most what the context leaves after the prompt, and at least 1;
    None (the rest of the context) stays None."""
    if requested is None:
        return None
    return max(1, min(requested, max_model_len - num_prompt_tokens))
