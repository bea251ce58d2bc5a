"""A checkpoint that reasons, then answers, by rote (a helper module, not tests).

The tiny tokenizer with <think> and </think> added (one token each, not special, as in Qwen3's
and DeepSeek-R1's), a chat template in Qwen3's manner (the generation prompt opens the
assistant's turn with <think>; with enable_thinking false, with an empty <think></think>; an
earlier assistant turn's reasoning_content shown in its <think></think>), and
weights that write one fixed text: every attention o_proj and MLP down_proj zero and the norms
at one leave the residual stream at the last token's embedding, so the next token depends on
the last one alone. The text's tokens get embeddings along axes of their own, and the LM head
maps each one's axis to the token after it (every other row zero):

    <think> → REASONING's tokens → </think> → CONTENT's tokens → <|im_end|> (the end of the answer)

So a prompt that ends in <think> is answered REASONING + "</think>" + CONTENT, and one that
ends in </think> (thinking switched off) CONTENT alone: a random-weight model would repeat one
token, and could not show the split.
"""

import pathlib
import tempfile

import torch
from safetensors.torch import load_file, save_file
from tokenizers import AddedToken, Tokenizer

from tests.tiny_checkpoints import build_tiny_checkpoint
from tests.tiny_tokenizer import TINY_VOCAB_SIZE, tiny_tokenizer
from tinyserve.models.tokenizer import IM_END_TOKEN, save_tokenizer_files

REASONING = " this is better than that"
CONTENT = " return the list"
TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['reasoning_content'] is defined -%}{{- '<think>' + message['reasoning_content'] + '</think>' -}}"
    "{%- endif -%}"
    "{{- message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n<think>' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}{{- '</think>' -}}{%- endif -%}"
    "{%- endif -%}"
)
_dirs: list[tempfile.TemporaryDirectory] = []
_built: list[pathlib.Path] = []


def reasoning_checkpoint() -> pathlib.Path:
    """The model folder, built once per process."""
    if _built:
        return _built[0]
    tokenizer = Tokenizer.from_str(tiny_tokenizer(TINY_VOCAB_SIZE).to_str())  # a copy: the cached one is shared
    tokenizer.add_tokens([AddedToken("<think>", special=False), AddedToken("</think>", special=False)])
    chain = [tokenizer.token_to_id("<think>"), *tokenizer.encode(REASONING).ids, tokenizer.token_to_id("</think>"),
             *tokenizer.encode(CONTENT).ids, tokenizer.token_to_id(IM_END_TOKEN)]
    if len(set(chain)) != len(chain):
        raise ValueError(f"the answer's tokens must be distinct, each with one successor: {chain}")
    _dirs.append(tempfile.TemporaryDirectory(prefix="tinyserve-reasoning-"))
    folder = build_tiny_checkpoint(pathlib.Path(_dirs[-1].name) / "llama", "llama", tie_word_embeddings=False,
                                   vocab_size=TINY_VOCAB_SIZE + 8, eos_token_id=chain[-1])
    weights = load_file(folder / "model.safetensors")
    for name, tensor in weights.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            weights[name] = torch.zeros_like(tensor)
        elif name.endswith("norm.weight"):
            weights[name] = torch.ones_like(tensor)
    embed, head = weights["model.embed_tokens.weight"], torch.zeros_like(weights["lm_head.weight"])
    for axis, (token, successor) in enumerate(zip(chain, chain[1:])):
        embed[token] = 0
        embed[token, axis] = 1.0
        head[successor, axis] = 10.0
    weights["lm_head.weight"] = head
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    save_tokenizer_files(tokenizer, folder, TEMPLATE)
    _built.append(folder)
    return folder
