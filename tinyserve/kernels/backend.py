"""The attention backend interface: one seam between the model and its kernels.

A layer of the model calls two things per step:

    backend.write_kv(key, value, kv_cache, metadata)     # store this step's K/V
    out = backend.attention(query, kv_cache, metadata, scale)

Every backend (the PyTorch reference, the CPU's decode kernel, Triton kernels) takes
the same tensors and must return the same numbers. The model never looks inside.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:  # the command line reads ATTENTION_BACKENDS without loading torch
    import torch

    from tinyserve.kernels.metadata import AttentionMetadata


class AttentionBackend(Protocol):
    name: str

    def write_kv(
        self,
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
    ) -> None: ...

    def attention(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor: ...  # [num_tokens, num_heads, head_dim]


ATTENTION_BACKENDS = ("torch", "cpu", "triton")

logger = logging.getLogger(__name__)


def get_attention_backend(name: str, device: torch.device, max_model_len: int) -> AttentionBackend:
    """Return the backend called `name` (ATTENTION_BACKENDS), for sequences of up to max_model_len tokens."""
    if name == "torch":
        from tinyserve.kernels.torch_attention import TorchAttentionBackend

        return TorchAttentionBackend()
    if name == "cpu":
        if device.type != "cpu":
            raise ValueError(f"attention_backend='cpu' runs on the CPU only, not on {device.type}")
        from tinyserve.kernels.cpu_backend import CpuAttentionBackend

        return CpuAttentionBackend()
    if name == "triton":
        from tinyserve.kernels.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend(device, max_model_len)
    raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {name!r}")


def default_attention_backend(device: torch.device) -> str:
    """Triton kernels on CUDA, the CPU's decode kernel on the CPU (if it runs here), the PyTorch reference elsewhere."""
    if device.type == "cpu":
        from tinyserve.kernels.cpu_decode_attention import why_unusable

        reason = why_unusable()
        if reason is None:
            return "cpu"
        logger.warning("the CPU's decode attention kernel cannot run here (%s): using the torch backend", reason)
    return "triton" if device.type == "cuda" else "torch"
