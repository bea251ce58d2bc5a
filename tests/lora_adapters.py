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


def tampered_adapter(source, destination, *, config: dict | None = None, fill: float | None = None):
    """A copy of the adapter folder `source` at `destination` (a path), as an attacker would edit it: `config`'s
    fields set in its adapter_config.json (json writes NaN as NaN), every lora_B weight set to `fill`."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    destination = pathlib.Path(destination)
    shutil.copytree(source, destination, dirs_exist_ok=True)
    if config:
        config_file = destination / "adapter_config.json"
        config_file.write_text(json.dumps({**json.loads(config_file.read_text()), **config}))
    if fill is not None:
        weights_file = destination / "adapter_model.safetensors"
        weights = load_file(weights_file)
        save_file({key: torch.full_like(value, fill) if ".lora_B." in key else value
                   for key, value in weights.items()}, weights_file)
    return destination
