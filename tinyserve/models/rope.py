"""Rotary position embeddings (RoPE), precomputed for every position the model allows.

RoPE turns a query or key into a position-dependent rotation: the head vector is cut
into pairs, and pair i is rotated by the angle  position * inv_freq[i].  The angles
depend only on the position, so cos and sin are computed once at start-up for
positions 0 .. max_position_embeddings - 1, and each step just looks its rows up by
`positions` (the flattened batch's token positions, prefill and decode alike).

The pairing follows Hugging Face's `rotate_half` convention (GPT-NeoX style), not
the interleaved one of the original paper: element j is paired with j + head_dim/2.

    x           = [ x1 | x2 ]            (two halves of head_dim)
    rotate_half = [-x2 | x1 ]
    x * cos + rotate_half(x) * sin  =  [ x1*cos - x2*sin | x2*cos + x1*sin ]

Checkpoints trained with this convention give wrong answers under the other one, so
the cos/sin tables repeat their frequencies the same way: [f0..f(d/2-1), f0..f(d/2-1)].

`rotate` computes the same products in fewer ops: it rolls x by half a head, [x2 | x1]
(one op, where rotate_half is a negation and a concatenation), and multiplies by a sine
table whose first half is negated, [-sin | sin], once at start-up. (-x2) * sin and
x2 * (-sin) are the same number in floating point, so the result is rotate_half's, bit
for bit: 20-30 % faster over a decode batch's q and k, the same count of multiplications.
On the CPU backend, kernels/cpu_elementwise.py's `rotate` computes it in one pass, to the same bits.

Supported `rope_type`s: "default", "linear" (positions divided by a factor) and
"llama3" (Llama 3.1's long-context rescaling of the low frequencies).
"""

import math

import torch
from torch import nn

ROPE_TYPES = ("default", "linear", "llama3")


def get_rope_parameters(config) -> dict:
    """The RoPE parameters of a config, whichever transformers version wrote them.

    transformers 5 keeps one dict, `config.rope_parameters`, that holds rope_theta too;
    transformers 4 spread them over `config.rope_theta` and `config.rope_scaling`.
    """
    params = getattr(config, "rope_parameters", None)
    if params is None:
        params = dict(getattr(config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params = dict(params)
    # Old configs spell the type "type"; no type at all means plain RoPE.
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    return params


def compute_inv_freq(head_dim: int, params: dict) -> torch.Tensor:
    """The rotation speed of each of the head_dim/2 pairs: [head_dim // 2] float32."""
    rope_type = params["rope_type"]
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"rope_type must be one of {ROPE_TYPES}, got {rope_type!r}")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(
            f"partial_rotary_factor must be 1.0 (RoPE over the whole head), got {params['partial_rotary_factor']}"
        )
    base = params["rope_theta"]
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    if rope_type == "linear":
        # Scaling the positions by 1/factor is the same as scaling the frequencies.
        return inv_freq / params["factor"]
    if rope_type == "llama3":
        return _llama3_scaled(inv_freq, params)
    return inv_freq


def _llama3_scaled(inv_freq: torch.Tensor, params: dict) -> torch.Tensor:
    """Llama 3.1 scaling: slow down long wavelengths, keep short ones, blend in between.

        wavelength:  short  <  old_len/high_freq_factor  ...  old_len/low_freq_factor  <  long
        inv_freq:    kept                 smooth mix of kept and /factor               /factor
    """
    factor = params["factor"]
    low_freq_factor = params["low_freq_factor"]
    high_freq_factor = params["high_freq_factor"]
    old_context_len = params["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor

    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """[x1 | x2] -> [-x2 | x1] along the last axis (see the module docstring)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RotaryEmbedding(nn.Module):
    """Applies RoPE to queries and keys of a flattened batch, by token position."""

    def __init__(self, head_dim: int, max_position_embeddings: int, rope_parameters: dict):
        super().__init__()
        if head_dim % 2 != 0:
            raise ValueError(f"head_dim must be even for RoPE, got {head_dim}")
        inv_freq = compute_inv_freq(head_dim, rope_parameters)
        positions = torch.arange(max_position_embeddings, dtype=torch.float)
        freqs = positions[:, None] * inv_freq[None, :]  # [max_pos, head_dim/2]
        angles = torch.cat((freqs, freqs), dim=-1)  # [max_pos, head_dim]: halves repeat
        # Computed in float32 and rounded to the activations' dtype at use, as
        # transformers does (model.to(bfloat16) rounds them the same way, once).
        self.cos_cache = nn.Buffer(angles.cos(), persistent=False)
        half = head_dim // 2
        signed_sin = angles.sin()
        signed_sin[:, :half] = -signed_sin[:, :half]  # [-sin | sin]: rotate's table (the module docstring)
        self.signed_sin_cache = nn.Buffer(signed_sin, persistent=False)

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and [-sin | sin] for each token, [num_tokens, 1, head_dim] (broadcast over its heads), in `dtype`.

        The same for every layer: the model looks them up once per step.
        """
        return (self.cos_cache[positions].to(dtype)[:, None, :],
                self.signed_sin_cache[positions].to(dtype)[:, None, :])

    @staticmethod
    def rotate(cos_sin: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """x [num_tokens, heads, head_dim] rotated by its tokens' angles (any number of heads).

        x * cos + rotate_half(x) * sin, as x * cos + [x2 | x1] * [-sin | sin] (the module docstring).
        """
        cos, signed_sin = cos_sin
        return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin

    def forward(
        self,
        positions: torch.Tensor,  # [num_tokens] int64
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos_sin = self.lookup(positions, query.dtype)
        return self.rotate(cos_sin, query), self.rotate(cos_sin, key)
