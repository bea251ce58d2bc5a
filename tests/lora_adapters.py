"""Tiny PEFT LoRA adapters for tests, and transformers + PEFT's greedy tokens under them (a helper module).

Each adapter is made by PEFT itself on a tiny checkpoint (tiny_checkpoints.py):
`get_peft_model(model, LoraConfig(...))`, then lora_A and lora_B set to random non-zero
values from a fixed seed (PEFT starts lora_B at zero, which would hide every mistake),
then `save_pretrained`: adapter_config.json and adapter_model.safetensors, as the hub
stores adapters.

    path = peft_adapter(folder, "sql", r=4, lora_alpha=8, seed=1)   # built once per session
    expected = peft_greedy(folder, path, prompt)                      # 16 tokens, greedy
"""

import pathlib
import tempfile

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM

from tests.hf_reference import MAX_TOKENS

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

_dir: tempfile.TemporaryDirectory | None = None
_built: dict[tuple, pathlib.Path] = {}
_models: dict[tuple, torch.nn.Module] = {}


def peft_adapter(folder, name: str, *, r: int = 4, lora_alpha: int = 8, seed: int = 1,
                 target_modules=ALL_TARGETS, **config) -> pathlib.Path:
    """A PEFT adapter for the checkpoint `folder`, saved once per session (config: more LoraConfig fields)."""
    global _dir
    key = (str(folder), name, r, lora_alpha, seed, tuple(target_modules), repr(sorted(config.items())))
    if key not in _built:
        if _dir is None:
            _dir = tempfile.TemporaryDirectory(prefix="tinyserve-lora-")
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        peft_model = get_peft_model(model, LoraConfig(r=r, lora_alpha=lora_alpha, target_modules=list(target_modules),
                                                      **config))
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for param_name, param in peft_model.named_parameters():
                if ".lora_A." in param_name or ".lora_B." in param_name:
                    param.copy_(0.3 * torch.randn(param.shape, generator=generator))
        path = pathlib.Path(_dir.name) / f"{name}-{len(_built)}"
        peft_model.save_pretrained(path)
        _built[key] = path
    return _built[key]


def peft_model(folder, adapter) -> torch.nn.Module:
    """transformers' model of `folder` with the adapter (None: none) loaded by PEFT, once per process."""
    key = (str(folder), str(adapter))
    if key not in _models:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        _models[key] = (PeftModel.from_pretrained(model, adapter) if adapter is not None else model).eval()
    return _models[key]


def peft_greedy(folder, adapter, prompt: list[int]) -> list[int]:
    """The MAX_TOKENS tokens transformers + PEFT generate greedily after `prompt` under `adapter`."""
    with torch.no_grad():
        out = peft_model(folder, adapter).generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False)
    return out[0, len(prompt):].tolist()
