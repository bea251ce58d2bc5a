"""transformers' own greedy `generate` on a checkpoint folder (a helper module, not tests).

What tinyserve's greedy tokens must equal, token for token:

    expected = hf_greedy(folder, prompt_token_ids)    # 16 new tokens, greedy, EOS honoured
    expected = hf_greedy(folder, prompt_token_ids, kv_dtype=torch.bfloat16)   # its cache rounded to bf16

Each folder's model is loaded once per process, in float32.
"""

import torch
from transformers import AutoModelForCausalLM, DynamicCache

MAX_TOKENS = 16

_HF_MODELS = {}


def hf_model(folder):
    """The transformers model of `folder`, loaded once per process (float32, eval mode)."""
    if folder not in _HF_MODELS:
        _HF_MODELS[folder] = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return _HF_MODELS[folder]


class RoundingCache(DynamicCache):
    """transformers' cache, rounding each key and value to `dtype` (and back to float32) as it stores them:
    what tinyserve's --kv-cache-dtype does to its pool."""

    def __init__(self, dtype: torch.dtype, **kwargs):
        super().__init__(**kwargs)
        self.kv_dtype = dtype

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        rounded = key_states.to(self.kv_dtype).float(), value_states.to(self.kv_dtype).float()
        return super().update(*rounded, layer_idx, *args, **kwargs)


def hf_greedy(folder, prompt: list[int], kv_dtype: torch.dtype | None = None) -> list[int]:
    """The MAX_TOKENS token ids transformers generates greedily after `prompt` (its cache rounded to kv_dtype)."""
    model = hf_model(folder)
    cache = {} if kv_dtype is None else {"cache": RoundingCache(kv_dtype, config=model.config)}
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False, **cache)
    return out[0, len(prompt):].tolist()
