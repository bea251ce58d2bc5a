"""A checkpoint that repeats its last token for ever (a helper module, not tests).

Tied embeddings, every attention o_proj and MLP down_proj zero, norms at 1: the residual
stream stays the last token's embedding, and its logits E·e_x peak at x itself. Every
n-gram draft of its output is right: speculative decoding's best case, for tests and
benchmarks/spec_decode.py.
"""

import pathlib
import tempfile

import torch
from safetensors.torch import load_file, save_file

from tests.tiny_checkpoints import build_tiny_checkpoint
from tests.tiny_tokenizer import TINY_VOCAB_SIZE, tiny_tokenizer_files

_built: dict[tuple, pathlib.Path] = {}
_dirs: list[tempfile.TemporaryDirectory] = []


def repeating_checkpoint(family: str = "llama", **kwargs) -> pathlib.Path:
    kwargs.setdefault("vocab_size", TINY_VOCAB_SIZE)
    key = (family, tuple(sorted(kwargs.items())))
    if key not in _built:
        _dirs.append(tempfile.TemporaryDirectory(prefix="tinyserve-repeating-"))
        folder = build_tiny_checkpoint(pathlib.Path(_dirs[-1].name) / family, family, tie_word_embeddings=True,
                                       **kwargs)
        weights = load_file(folder / "model.safetensors")
        for name, tensor in weights.items():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                weights[name] = torch.zeros_like(tensor)
            elif name.endswith("norm.weight"):
                weights[name] = torch.ones_like(tensor)
        save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
        tiny_tokenizer_files(folder)
        _built[key] = folder
    return _built[key]
