"""An adapter saved in PEFT's format, read and checked against the base model.

A PEFT LoRA adapter is a folder of two files:

    adapter_config.json         r, lora_alpha, use_rslora, target_modules, ... (PEFT's LoraConfig)
    adapter_model.safetensors   base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight  [r, in]
                                base_model.model.model.layers.3.self_attn.q_proj.lora_B.weight  [out, r]

PEFT computes each adapted projection as `base(x) + lora_B(lora_A(dropout(x))) * scaling`,
scaling = lora_alpha / r (lora_alpha / sqrt(r) with use_rslora); dropout is the identity
at inference. The json library reads the config; the safetensors library reads the
weights: it parses the file's header (names, dtypes, shapes, offsets) and hands each
tensor over from a memory map, with no pickle and so no code run from the file.

Everything PEFT can save that would change the outputs and that this layer does not
compute is refused, named: DoRA, modules_to_save, biases, per-module rank or alpha
patterns, a subset of layers, adapted embeddings or LM head. So is an adapter whose
rank is over max_lora_rank, or whose shapes are not this base model's, and one whose
values would make a step's activations overflow (check_weight_values): a config field of
the wrong type or not finite (`lora_alpha: NaN`), a weight that is nan, inf, or so large
that the update overflows (1e30). Every refusal is a LoRAConfigError naming the adapter;
the engine then refuses the request alone instead of failing a step.
"""

import json
import math
import pathlib
import re
from dataclasses import dataclass

import torch
from safetensors import safe_open

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

# The projections an adapter may target, and the model module (and its slice) each adds to.
TARGET_MODULES = {
    "q_proj": ("self_attn.qkv_proj", 0), "k_proj": ("self_attn.qkv_proj", 1), "v_proj": ("self_attn.qkv_proj", 2),
    "o_proj": ("self_attn.o_proj", 0),
    "gate_proj": ("mlp.gate_up_proj", 0), "up_proj": ("mlp.gate_up_proj", 1),
    "down_proj": ("mlp.down_proj", 0),
}
# Config fields whose non-default values change the outputs in ways not computed here.
_UNSUPPORTED = {
    "use_dora": (False, "DoRA (use_dora)"),
    "modules_to_save": (None, "modules_to_save (fully trained copies of base modules)"),
    "lora_bias": (False, "lora_bias (a bias on lora_B)"),
    "rank_pattern": ({}, "rank_pattern (a rank per module)"),
    "alpha_pattern": ({}, "alpha_pattern (an alpha per module)"),
    "layers_to_transform": (None, "layers_to_transform (a subset of layers)"),
    "layer_replication": (None, "layer_replication"),
    "fan_in_fan_out": (False, "fan_in_fan_out (transposed weights)"),
    "target_parameters": (None, "target_parameters"),
    "trainable_token_indices": (None, "trainable_token_indices"),
    "use_qalora": (False, "QALoRA (use_qalora)"),
    "alora_invocation_tokens": (None, "aLoRA (alora_invocation_tokens)"),
}
_KEY = re.compile(r"^(?:base_model\.model\.)?(?:model\.)?layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


# The most an adapter's update may change one weight of the base model (check_weight_values).
MAX_WEIGHT_CHANGE = 1e4


class LoRAConfigError(ValueError):
    """An adapter this engine cannot serve; the message names the adapter and the reason."""


@dataclass(slots=True)
class PeftAdapter:
    """One adapter's weights: weights[(layer, target)] = (A [r, in], B [out, r]), and its scaling."""

    name: str
    rank: int
    scaling: float
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    @property
    def target_modules(self) -> list[str]:
        return sorted({target for _, target in self.weights})


def read_adapter_config(path: str | pathlib.Path, name: str) -> dict:
    """The adapter's config, read as JSON. A path that does not exist, is no folder, cannot be read or holds no
    adapter gets one answer: whoever may name a path (/v1/load_lora_adapter) learns nothing of what is there."""
    folder = pathlib.Path(path).expanduser()
    try:
        text = (folder / CONFIG_FILE).read_bytes() if (folder / WEIGHTS_FILE).is_file() else None
    except (OSError, ValueError):  # missing, a folder, unreadable, a NUL in the path
        text = None
    if text is None:
        raise LoRAConfigError(f"LoRA adapter {name!r}: {str(folder)!r} holds no readable PEFT adapter "
                              f"({CONFIG_FILE} and {WEIGHTS_FILE}: only PEFT's safetensors format is read)")
    try:
        config = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise LoRAConfigError(f"LoRA adapter {name!r}: {CONFIG_FILE} is not valid JSON: {error}") from None
    if not isinstance(config, dict):
        raise LoRAConfigError(f"LoRA adapter {name!r}: {CONFIG_FILE} must hold a JSON object, "
                              f"got {type(config).__name__}")
    return config


def check_adapter_config(config: dict, name: str, max_lora_rank: int) -> tuple[int, float]:
    """(rank, scaling) of a supported config; raises LoRAConfigError naming what is not supported."""
    if config.get("peft_type", "LORA") != "LORA":
        raise LoRAConfigError(f"LoRA adapter {name!r}: peft_type {config.get('peft_type')!r} is not LoRA")
    for key, (default, what) in _UNSUPPORTED.items():
        if config.get(key, default) not in (default, None, {}, [], False):
            raise LoRAConfigError(f"LoRA adapter {name!r}: {what} is not supported")
    if config.get("bias", "none") != "none":
        raise LoRAConfigError(f"LoRA adapter {name!r}: bias={config['bias']!r} is not supported (only 'none')")
    targets = config.get("target_modules")
    if isinstance(targets, str):
        raise LoRAConfigError(f"LoRA adapter {name!r}: target_modules as a pattern ({targets!r}) is not supported; "
                              f"list them (any of {', '.join(TARGET_MODULES)})")
    if targets is not None and not (isinstance(targets, list) and all(isinstance(t, str) for t in targets)):
        raise LoRAConfigError(f"LoRA adapter {name!r}: target_modules must be a list of module names, got {targets!r}")
    unsupported = sorted(set(targets or ()) - set(TARGET_MODULES))
    if unsupported:
        raise LoRAConfigError(f"LoRA adapter {name!r}: target modules {unsupported} are not supported; "
                              f"supported: {', '.join(TARGET_MODULES)}")
    rank = config.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise LoRAConfigError(f"LoRA adapter {name!r}: r must be a positive integer, got {rank!r}")
    if rank > max_lora_rank:
        raise LoRAConfigError(f"LoRA adapter {name!r} has rank {rank}, over this server's max_lora_rank "
                              f"{max_lora_rank} (--max-lora-rank)")
    alpha = config.get("lora_alpha", 8)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise LoRAConfigError(f"LoRA adapter {name!r}: lora_alpha must be a finite number, got {alpha!r}")
    use_rslora = config.get("use_rslora", False)
    if not isinstance(use_rslora, bool):
        raise LoRAConfigError(f"LoRA adapter {name!r}: use_rslora must be true or false, got {use_rslora!r}")
    scaling = alpha / math.sqrt(rank) if use_rslora else alpha / rank
    return rank, scaling


def check_weight_values(name: str, layer: int, target: str, a: torch.Tensor, b: torch.Tensor, scaling: float,
                         dtype: torch.dtype) -> None:
    """Refuse weights that would make a step's activations overflow: a value not finite (nan, inf, or one the
    engine's dtype cannot hold), or a low-rank update that could move one weight by more than MAX_WEIGHT_CHANGE.

    |(scaling * B @ A)[i, j]| <= |scaling| * r * max|B| * max|A|, a bound computed in float64; trained adapters
    stay orders of magnitude below it (a base model's weights are mostly under 1). Weights of 1e30, say, are
    finite in float32 but overflow the attention's scores on the first step: NaN there fails every step after.
    """
    for which, weight in (("lora_A", a), ("lora_B", b)):
        if weight.is_floating_point() and not bool(torch.isfinite(weight.to(dtype)).all()):
            raise LoRAConfigError(f"LoRA adapter {name!r}: layer {layer} {target} {which} holds values that are not "
                                  f"finite in {str(dtype).removeprefix('torch.')} (nan, inf, or out of its range)")
    bound = abs(scaling) * a.shape[0] * float(a.abs().max().double()) * float(b.abs().max().double())
    if not bound <= MAX_WEIGHT_CHANGE:
        raise LoRAConfigError(f"LoRA adapter {name!r}: layer {layer} {target} could change a weight by up to "
                              f"{bound:.3g} (scaling x r x max|B| x max|A|), over the {MAX_WEIGHT_CHANGE:g} "
                              "this server accepts: its values would overflow the activations")


def expected_shapes(model_config: dict) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each target module of the base model, from its config.json."""
    hidden, inter = model_config["hidden_size"], model_config["intermediate_size"]
    heads = model_config["num_attention_heads"]
    kv_heads = model_config.get("num_key_value_heads") or heads
    head_dim = model_config.get("head_dim") or hidden // heads
    q, kv = heads * head_dim, kv_heads * head_dim
    return {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
            "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}


def _read_weights(path, name: str, num_layers: int) -> dict[tuple[int, str], dict[str, torch.Tensor]]:
    """{(layer, target): {"A": lora_A, "B": lora_B}} as the weights file holds them."""
    parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    with safe_open(pathlib.Path(path).expanduser() / WEIGHTS_FILE, framework="pt", device="cpu") as f:
        for key in f.keys():
            match = _KEY.match(key)
            if match is None or match.group(3) not in TARGET_MODULES:
                raise LoRAConfigError(f"LoRA adapter {name!r}: weight {key!r} adapts a module that is not "
                                      f"supported (supported: {', '.join(TARGET_MODULES)})")
            layer, target = int(match.group(1)), match.group(3)
            if layer >= num_layers:
                raise LoRAConfigError(f"LoRA adapter {name!r} was trained for another base model: it adapts "
                                      f"layer {layer}, this model has {num_layers}")
            parts.setdefault((layer, target), {})[match.group(4)] = f.get_tensor(key)
    return parts


def load_peft_adapter(path: str | pathlib.Path, name: str, model_config: dict, max_lora_rank: int,
                      dtype: torch.dtype = torch.float32) -> PeftAdapter:
    """Read and check an adapter for the base model of `model_config` (its config.json as a dict)."""
    config = read_adapter_config(path, name)
    rank, scaling = check_adapter_config(config, name, max_lora_rank)
    shapes, num_layers = expected_shapes(model_config), model_config["num_hidden_layers"]
    try:
        parts = _read_weights(path, name, num_layers)
    except (LoRAConfigError, MemoryError):
        raise
    except Exception as error:  # a truncated or malformed safetensors file, a file that went away
        raise LoRAConfigError(f"LoRA adapter {name!r}: {WEIGHTS_FILE} cannot be read: {error}") from None
    weights = {}
    for (layer, target), ab in sorted(parts.items()):
        if set(ab) != {"A", "B"}:
            raise LoRAConfigError(f"LoRA adapter {name!r}: layer {layer} {target} lacks lora_{({'A', 'B'} - set(ab)).pop()}")
        a, b = ab["A"], ab["B"]
        if not (a.is_floating_point() and b.is_floating_point()):
            raise LoRAConfigError(f"LoRA adapter {name!r}: layer {layer} {target} has weights of dtype "
                                  f"{str(a.dtype).removeprefix('torch.')}/{str(b.dtype).removeprefix('torch.')}, "
                                  "not floating point")
        in_features, out_features = shapes[target]
        if a.shape != (rank, in_features) or b.shape != (out_features, rank):
            raise LoRAConfigError(
                f"LoRA adapter {name!r} was trained for another base model: layer {layer} {target} has lora_A "
                f"{list(a.shape)} and lora_B {list(b.shape)}, this model needs [{rank}, {in_features}] and "
                f"[{out_features}, {rank}]")
        check_weight_values(name, layer, target, a, b, scaling, dtype)
        weights[(layer, target)] = (a.to(dtype).contiguous(), b.to(dtype).contiguous())
    if not weights:
        raise LoRAConfigError(f"LoRA adapter {name!r}: {WEIGHTS_FILE} holds no LoRA weights")
    return PeftAdapter(name, rank, scaling, weights)
