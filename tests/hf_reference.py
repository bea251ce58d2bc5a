"""transformers' own greedy `generate` on a checkpoint folder (a helper module, not tests).

What tinyserve's greedy tokens must equal, token for token:

    expected = hf_greedy(folder, prompt_token_ids)    # 16 new tokens, greedy, EOS honoured

Each folder's model is loaded once per process, in float32.
"""

import torch
from transformers import AutoModelForCausalLM

MAX_TOKENS = 16

_HF_MODELS = {}


def hf_model(folder):
    """The transformers model of `folder`, loaded once per process (float32, eval mode)."""
    if folder not in _HF_MODELS:
        _HF_MODELS[folder] = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return _HF_MODELS[folder]


def hf_greedy(folder, prompt: list[int]) -> list[int]:
    """The MAX_TOKENS token ids transformers generates greedily after `prompt`."""
    model = hf_model(folder)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False)
    return out[0, len(prompt):].tolist()
