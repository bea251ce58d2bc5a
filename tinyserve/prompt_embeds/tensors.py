"""A prompt given as embeddings, checked at the boundary and packed for the engine (stage ②).

vLLM's completions take `prompt_embeds` as a tensor saved with `torch.save` and encoded in base64;
its offline LLM takes the tensor itself, `{"prompt_embeds": tensor}`. Either way the tensor must be

    2-D, [num_tokens, hidden_size]      (a batch of one, [1, num_tokens, hidden_size], is squeezed)
    hidden_size the model's              num_tokens at most max_model_len
    floating point, finite               cast to the model's dtype, so a client need not know it

and each problem is a 400 naming `prompt_embeds`. Before anything is decoded, the base64 text is
bounded by what the largest acceptable tensor could take: max_model_len rows of hidden_size
float64 values, plus what torch.save's zip archive adds around them. `torch.load(weights_only=True)`
reads tensors and plain containers only, never code, so a caller's bytes cannot run anything.

The checked rows travel as raw bytes with their shape and dtype (PromptEmbeds), and the prompt's
token ids become that many placeholders (0s, as vLLM's): the scheduler counts them as the prompt's
tokens, the model runner never looks them up (inputs.py).
"""

import base64
import binascii
import io
import math

import torch

from tinyserve.errors import InvalidInputError
from tinyserve.wire.messages import PromptEmbeds

PARAM = "prompt_embeds"
ARCHIVE_OVERHEAD_BYTES = 64 * 1024  # torch.save's zip entries and pickled header around the values
_MAX_REASON_CHARS = 200  # torch's reason for refusing the bytes, built from them, is cut to this


def max_payload_bytes(model_info) -> int:
    """The most bytes an acceptable tensor's torch.save archive can take: float64, max_model_len rows."""
    return model_info.max_model_len * model_info.hidden_size * 8 + ARCHIVE_OVERHEAD_BYTES


def decode_prompt_embeds(encoded: str, model_info) -> PromptEmbeds:
    """The API's form: torch.save's bytes in base64, bounded, read, then checked as a tensor."""
    limit = max_payload_bytes(model_info)
    if len(encoded) > 4 * math.ceil(limit / 3):
        raise InvalidInputError(f"prompt_embeds is {len(encoded)} base64 characters, more than a tensor of at most "
                                f"max_model_len={model_info.max_model_len} rows of hidden_size="
                                f"{model_info.hidden_size} takes ({limit} bytes)", PARAM)
    try:
        payload = base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError) as error:
        raise InvalidInputError(f"prompt_embeds is not base64: {error}", PARAM) from None
    try:
        tensor = torch.load(io.BytesIO(payload), weights_only=True, map_location="cpu")
    except MemoryError:
        raise
    except Exception as error:  # torch has no one error type for "not a tensor file"
        reason = (str(error).strip() or type(error).__name__)[:_MAX_REASON_CHARS]
        raise InvalidInputError(f"prompt_embeds could not be read as a tensor saved with torch.save: {reason}",
                                PARAM) from None
    return check_prompt_embeds(tensor, model_info)


def check_prompt_embeds(tensor, model_info) -> PromptEmbeds:
    """A tensor checked against the model (module docstring), cast to its dtype, packed for the wire."""
    if not isinstance(tensor, torch.Tensor) or tensor.layout != torch.strided:
        raise InvalidInputError(f"prompt_embeds must be a dense torch tensor, got {_kind(tensor)}", PARAM)
    if tensor.dim() == 3 and tensor.shape[0] == 1:
        tensor = tensor.squeeze(0)
    if tensor.dim() != 2:
        raise InvalidInputError(f"prompt_embeds must be a 2-D tensor of shape (num_tokens, hidden_size); got shape "
                                f"{tuple(tensor.shape)}", PARAM)
    rows, hidden_size = tensor.shape
    if not 1 <= rows <= model_info.max_model_len:
        raise InvalidInputError(f"prompt_embeds has {rows} rows (tokens); it must have 1 to max_model_len="
                                f"{model_info.max_model_len}", PARAM)
    if hidden_size != model_info.hidden_size:
        raise InvalidInputError(f"prompt_embeds hidden_size {hidden_size} does not match the model's hidden_size "
                                f"{model_info.hidden_size}", PARAM)
    if not tensor.is_floating_point():
        raise InvalidInputError(f"prompt_embeds dtype {tensor.dtype} is not a floating-point type; it cannot be cast "
                                f"to the model's dtype {model_info.torch_dtype}", PARAM)
    tensor = tensor.detach().to("cpu", model_info.torch_dtype).contiguous()
    if not torch.isfinite(tensor).all():
        raise InvalidInputError(f"prompt_embeds has values that are not finite (NaN or infinity) in the model's "
                                f"dtype {model_info.torch_dtype}", PARAM)
    return PromptEmbeds(tensor.view(torch.uint8).numpy().tobytes(), rows, hidden_size,
                        str(tensor.dtype).removeprefix("torch."))


def as_tensor(embeds: PromptEmbeds) -> torch.Tensor:
    """The rows back as a [rows, hidden_size] tensor of their dtype (a copy of the bytes, which are read-only)."""
    values = torch.frombuffer(bytearray(embeds.data), dtype=torch.uint8)
    return values.view(getattr(torch, embeds.dtype)).view(embeds.rows, embeds.hidden_size)


def _kind(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.layout} tensor"
    return f"a {type(value).__name__}"
