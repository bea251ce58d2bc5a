"""Tiny random-weight Hugging Face checkpoints for tests (a helper module, not tests).

Each checkpoint is built by transformers itself (`AutoModelForCausalLM.from_config`
after a fixed seed) and saved the way the hub stores models: config.json,
generation_config.json and model.safetensors (or shards plus an index). So whatever
tinyserve computes can be compared with what transformers computes on the same files.

The shapes are chosen to catch the usual mistakes cheaply:
    4 query heads over 2 KV heads      grouped-query attention
    head_dim 24 with hidden_size 64    head_dim != hidden_size / num_heads, and not a power of two
    2 layers, vocab 384                fast on a CPU
and the weights are larger than transformers' default (initializer_range 0.3), so that
greedy decoding wanders over many tokens instead of repeating one forever.

    path = tiny_checkpoint("qwen3", tie_word_embeddings=True)   # built once per session

No tokenizer is written here: tests feed token ids.
"""

import pathlib
import tempfile

import torch
from transformers import AutoConfig, AutoModelForCausalLM

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")

# Llama 3.1-style RoPE scaling, with an original context short enough (64) that the
# tiny model's frequencies fall in all three bands: kept, smoothed and divided.
LLAMA3_ROPE_PARAMETERS = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}

# What differs between the families beyond their model_type.
FAMILY_CONFIG = {
    "llama": {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}},
    # Mistral's config defaults to a 4096-token sliding window; these models do not slide.
    "mistral": {"sliding_window": None, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}},
    "qwen2": {"rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}},
    "qwen3": {"rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}},
}


def build_tiny_checkpoint(
    path: str | pathlib.Path,
    family: str,
    *,
    tie_word_embeddings: bool,
    seed: int = 0,
    vocab_size: int = 384,
    head_dim: int = 24,
    max_shard_size: str | None = None,
    **overrides,
) -> pathlib.Path:
    """Write a tiny random checkpoint of `family` to `path` and return the folder.

    overrides are config fields (e.g. rope_parameters=LLAMA3_ROPE_PARAMETERS,
    sliding_window=32). max_shard_size (e.g. "100KB") saves sharded safetensors.
    """
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")
    fields = {
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": head_dim,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-6,
        "initializer_range": 0.3,
        "tie_word_embeddings": tie_word_embeddings,
        "bos_token_id": 1,
        "eos_token_id": 2,
        **FAMILY_CONFIG[family],
        **overrides,
    }
    config = AutoConfig.for_model(family, **fields)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        # Norm weights start at exactly 1 and biases at 0, which would hide a norm
        # applied in the wrong place or a bias left out. Jitter them.
        for param in model.parameters():
            if param.dim() == 1:
                param.add_(0.1 * torch.randn_like(param))
    path = pathlib.Path(path)
    save_kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, safe_serialization=True, **save_kwargs)
    model.generation_config.save_pretrained(path)
    return path


_session_dir: tempfile.TemporaryDirectory | None = None
_built: dict[tuple, pathlib.Path] = {}


def tiny_checkpoint(family: str, tie_word_embeddings: bool = False, with_tokenizer: bool = False, **kwargs) -> pathlib.Path:
    """build_tiny_checkpoint, once per test session for each set of arguments.

    The folders live in one temporary directory removed when the interpreter exits.
    Treat them as read-only: other tests reuse them.
    """
    global _session_dir
    key = (family, tie_word_embeddings, with_tokenizer, tuple(sorted((k, repr(v)) for k, v in kwargs.items())))
    if key not in _built:
        if _session_dir is None:
            _session_dir = tempfile.TemporaryDirectory(prefix="tinyserve-checkpoints-")
        tied = "tied" if tie_word_embeddings else "untied"
        folder = pathlib.Path(_session_dir.name) / f"{family}-{tied}-{len(_built)}"
        _built[key] = build_tiny_checkpoint(folder, family, tie_word_embeddings=tie_word_embeddings, **kwargs)
    return _built[key]


def tiny_model_with_tokenizer(family: str = "llama", tie_word_embeddings: bool = False, **kwargs) -> pathlib.Path:
    """A tiny checkpoint plus the tiny trained tokenizer and its chat template: a servable model folder."""
    from tests.tiny_tokenizer import TINY_VOCAB_SIZE, tiny_tokenizer_files

    kwargs.setdefault("vocab_size", TINY_VOCAB_SIZE)
    folder = tiny_checkpoint(family, tie_word_embeddings, with_tokenizer=True, **kwargs)
    if not (folder / "tokenizer.json").exists():
        tiny_tokenizer_files(folder)
    return folder
