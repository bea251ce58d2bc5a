"""Find a Hugging Face checkpoint on disk and load it into a LlamaForCausalLM.

A model is named either by a local folder (holding config.json and *.safetensors), by
a hub id such as "Qwen/Qwen3-0.6B" that is already in the local Hugging Face cache, or by
the name of a model that ships inside tinyserve (BUILT_IN: "tinyserve-default", and
"tinyserve-vision", which takes images). Nothing is ever downloaded: serving must not
depend on the network.

Loading reads config.json with transformers' AutoConfig, builds the model on the
target device and in the target dtype (never an fp32 copy first: a bf16 model would
need twice its memory for a moment), then copies the safetensors weights in by name. Names map one to one
after dropping Hugging Face's "model." prefix, except the projections the model
stacks into one matrix, which land in their rows of it:

    model.layers.3.self_attn.o_proj.weight  ->  layers.3.self_attn.o_proj.weight
    model.layers.3.self_attn.k_proj.weight  ->  layers.3.self_attn.qkv_proj.weight[q_size : q_size + kv_size]
    model.layers.3.mlp.up_proj.weight       ->  layers.3.mlp.gate_up_proj.weight[intermediate:]
    lm_head.weight                          ->  lm_head.weight

Every parameter must be found exactly once; a missing or unexpected name is an error
that lists them, never a silently random weight.

An image-text checkpoint (LLaVA: model_type "llava", WITH_IMAGES) wraps one of these language
models: config.json's `text_config` describes it and its tensors are named under "language_model."
(which is dropped first). Its image encoder's tensors (vision_tower., multi_modal_projector.) are
left here for the layer that runs images (tinyserve/multimodal/).
"""

import contextlib
import json
import pathlib

import torch
from huggingface_hub import snapshot_download
from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError
from safetensors import safe_open
from transformers import AutoConfig, PretrainedConfig

from tinyserve.kernels.backend import AttentionBackend
from tinyserve.kernels.cpu_bf16 import computes_bf16_in_fp32
from tinyserve.models import default_model
from tinyserve.models.llama import LlamaForCausalLM
from tinyserve.models.packed_linear import pack_linear_weights, packs_weights, widen_linear_weights
from tinyserve.models.pipeline_parallel import PipelineStage
from tinyserve.models.tensor_parallel import TensorParallel, checkpoint_slice

# config.json's model_type -> the architecture transformers names for it (its "architectures").
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM"}
SUPPORTED_MODEL_TYPES = tuple(ARCHITECTURES)
# Image-text checkpoints whose language model is one of the above: model_type -> its architecture.
WITH_IMAGES = {"llava": "LlavaForConditionalGeneration"}
LANGUAGE_MODEL_PREFIX = "language_model."
IMAGE_ENCODER_PREFIXES = ("vision_tower.", "multi_modal_projector.")


def text_config(config: dict) -> dict:
    """config.json's language model part: its text_config for an image-text checkpoint, else itself."""
    return config["text_config"] if config.get("model_type") in WITH_IMAGES else config

SINGLE_FILE = "model.safetensors"
SHARD_INDEX = "model.safetensors.index.json"


# The models that ship inside tinyserve (models/default_model.py), by name -> their folders' finders.
BUILT_IN = {"tinyserve-default": default_model.default_model_path, "tinyserve-vision": default_model.default_vision_path}
A_MODEL = ("a model is a folder of config.json and *.safetensors, a hub id already in the local Hugging Face cache, "
           f"or a built-in one ({', '.join(BUILT_IN)})")


def _is_path(model: str) -> bool:
    """Spelled as a path: a hub id is NAME or ORG/NAME, never /..., ./..., ~/... or A/B/C."""
    return model.startswith(("/", ".", "~")) or model.count("/") > 1 or "\\" in model


def resolve_model_path(model: str) -> pathlib.Path:
    """A local checkpoint folder, the cached snapshot folder of a hub id, or a built-in model's folder (a folder
    of that name in the working directory comes first)."""
    folder = pathlib.Path(model).expanduser()
    if not folder.exists() and model in BUILT_IN:
        return BUILT_IN[model]()
    if folder.is_dir():
        if not (folder / "config.json").is_file():
            raise ValueError(f"model folder {str(folder)!r} has no config.json, so it is not a model; {A_MODEL}")
        return folder
    if folder.exists():
        raise ValueError(f"model {model!r} is a file, not a checkpoint folder; {A_MODEL}")
    if _is_path(model):
        raise ValueError(f"model {model!r}: no such folder; {A_MODEL}")
    try:
        snapshot = pathlib.Path(snapshot_download(model, local_files_only=True))
    except HFValidationError:
        raise ValueError(f"model {model!r}: no such folder, and not a valid hub id; {A_MODEL}") from None
    except LocalEntryNotFoundError:
        raise ValueError(
            f"model {model!r}: no such folder, and not a hub id in the local Hugging Face cache. "
            f"tinyserve never downloads; fetch it first: hf download {model}"
        ) from None
    if not (snapshot / "config.json").is_file():
        raise ValueError(f"model {model!r}: the cached snapshot {str(snapshot)!r} has no config.json")
    return snapshot


def load_model(
    path: str | pathlib.Path,
    dtype: torch.dtype,
    device: torch.device,
    attention_backend: AttentionBackend,
    max_model_len: int | None = None,
    tp: TensorParallel | None = None,
    pp: PipelineStage | None = None,
) -> tuple[LlamaForCausalLM, PretrainedConfig]:
    """Build the model described by path/config.json and load its weights.

    max_model_len is the longest sequence the engine will run (default: the config's
    max_position_embeddings); it is only used to reject sliding-window attention
    whose window would actually cut a sequence short. With `tp`, this rank's shard of
    every weight is loaded (tensor_parallel.checkpoint_slice); with `pp`, this pipeline stage's
    weights only (pipeline_parallel.PipelineStage.owns).
    """
    path = pathlib.Path(path)
    config = AutoConfig.from_pretrained(path)
    if config.model_type in WITH_IMAGES:  # the language model it wraps (the image encoder: tinyserve/multimodal/)
        config = config.text_config
    if max_model_len is None:
        max_model_len = config.max_position_embeddings
    check_supported(config, max_model_len)
    # Built directly on the target device, in the target dtype; the random initial values
    # are all overwritten below (load_weights checks that every parameter is). Tensors
    # made with an explicit dtype keep it (RoPE's fp32 tables, rounded at use).
    with torch.device(device), default_dtype(dtype):
        model = LlamaForCausalLM(config, attention_backend, tp, pp)
    load_weights(model, path)
    weights_dtype = dtype
    if computes_bf16_in_fp32(torch.device(device), dtype):  # a CPU without bf16 matmuls: fp32 weights
        widen_linear_weights(model)
        weights_dtype = torch.float32
    if packs_weights(torch.device(device), weights_dtype):  # bf16 or fp32 on a CPU: weights in oneDNN's layout
        pack_linear_weights(model)
    # Serving never trains: no autograd bookkeeping, whatever context forward runs in.
    model.requires_grad_(False)
    model.eval()
    return model, config


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    """Floating-point tensors made without a dtype inside get `dtype`."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def check_architecture(config: dict, path: pathlib.Path) -> None:
    """config.json (as read) names a model tinyserve serves; checked before any field of one is read."""
    model_type = config.get("model_type")
    if model_type in ARCHITECTURES or (model_type in WITH_IMAGES and text_config(config).get("model_type")
                                       in ARCHITECTURES):
        return
    architectures = ", ".join(config.get("architectures") or [])
    given = f"{architectures} checkpoint (model_type {model_type!r})" if architectures else \
        f"checkpoint of model_type {model_type!r}"
    supported = ", ".join(f"{name} ({kind})" for kind, name in ARCHITECTURES.items())
    with_images = ", ".join(f"{name} ({kind})" for kind, name in WITH_IMAGES.items())
    raise ValueError(f"{path} holds a {given}, which tinyserve does not serve: it serves decoder-only text "
                     f"models, {supported}, and {with_images} over one of them")


def check_supported(config, max_model_len: int) -> None:
    """Reject configs this model class would run wrongly, naming what is unsupported."""
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"model_type {config.model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    if config.hidden_act != "silu":
        raise ValueError(f"hidden_act must be 'silu' (SwiGLU MLP), got {config.hidden_act!r}")
    # Mistral applies its window to every layer; Qwen2/3 only to layers whose
    # layer_types entry says "sliding_attention" (none, unless use_sliding_window).
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and "sliding_attention" not in layer_types:
        window = None
    if window is not None and window < max_model_len:
        raise ValueError(
            f"sliding window attention is not supported: sliding_window={window} is shorter "
            f"than max_model_len={max_model_len}; lower max_model_len to at most {window}"
        )


def checkpoint_files(path: pathlib.Path) -> list[pathlib.Path]:
    """The safetensors files of a checkpoint: one file, or the shards its index names."""
    if (path / SINGLE_FILE).is_file():
        return [path / SINGLE_FILE]
    if (path / SHARD_INDEX).is_file():
        weight_map = json.loads((path / SHARD_INDEX).read_text())["weight_map"]
        return [path / name for name in sorted(set(weight_map.values()))]
    raise ValueError(f"checkpoint {str(path)!r} has neither {SINGLE_FILE} nor {SHARD_INDEX}")


# Parameters the model stacks from several checkpoint projections, in row order, and
# the attribute of their module that gives each block's number of rows.
STACKED = {
    "self_attn.qkv_proj": (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "qkv_sizes"),
    "mlp.gate_up_proj": (("mlp.gate_proj", "mlp.up_proj"), "gate_up_sizes"),
}


def checkpoint_names(param_name: str) -> list[str]:
    """The checkpoint tensors that fill one parameter of the model."""
    for stacked, (parts, _) in STACKED.items():
        if f".{stacked}." in param_name:
            return [param_name.replace(stacked, part) for part in parts]
    return [param_name]


def parameter_rows(model: LlamaForCausalLM, name: str) -> tuple[str, slice]:
    """(parameter name, its rows) that checkpoint tensor `name` fills."""
    for stacked, (parts, sizes_attribute) in STACKED.items():
        for block, part in enumerate(parts):
            if f".{part}." in name:
                param_name = name.replace(part, stacked)
                module = model.get_submodule(param_name.rsplit(".", 2)[0])
                sizes = getattr(module, sizes_attribute)
                start = sum(sizes[:block])
                return param_name, slice(start, start + sizes[block])
    return name, slice(None)


def load_weights(model: LlamaForCausalLM, path: pathlib.Path) -> None:
    """Copy every tensor of the checkpoint into the parameter (rows) it belongs to."""
    # named_parameters() lists a tied lm_head.weight once, as embed_tokens.weight.
    params = dict(model.named_parameters())
    expected = {name for param_name in params for name in checkpoint_names(param_name)}
    loaded, unexpected = set(), []
    for file in checkpoint_files(path):
        with safe_open(file, framework="pt", device="cpu") as f:
            for hf_name in f.keys():
                if hf_name.startswith(IMAGE_ENCODER_PREFIXES):  # an image-text checkpoint's encoder: not here
                    continue
                name = tied_head_name(hf_name.removeprefix(LANGUAGE_MODEL_PREFIX).removeprefix("model."), model)
                if name not in expected:
                    if not is_ignorable(name, model):
                        unexpected.append(hf_name)
                    continue
                param_name, rows = parameter_rows(model, name)
                destination = params[param_name][rows]
                tensor = f.get_tensor(hf_name)
                if model.tp is not None:
                    tensor = checkpoint_slice(name, tensor, model.config, model.tp)
                if tensor.shape != destination.shape:
                    raise ValueError(
                        f"weight {hf_name!r} has shape {tuple(tensor.shape)}, "
                        f"the model expects {tuple(destination.shape)}"
                    )
                with torch.no_grad():
                    destination.copy_(tensor)  # copy_ also casts to the model's dtype
                loaded.add(name)
    missing = sorted(expected - loaded)
    if missing or unexpected:
        raise ValueError(
            f"checkpoint {str(path)!r} does not match {model.config.model_type}: "
            f"missing weights {missing}, unexpected weights {sorted(unexpected)}"
        )


def tied_head_name(name: str, model: LlamaForCausalLM) -> str:
    """A tied embedding is the LM head too: a last pipeline stage that does not hold the embedding
    takes that matrix as its lm_head.weight."""
    pp = model.pp
    if name == "embed_tokens.weight" and model.config.tie_word_embeddings and pp and pp.is_last and not pp.is_first:
        return "lm_head.weight"
    return name


def is_ignorable(name: str, model: LlamaForCausalLM) -> bool:
    """Tensors some checkpoints carry that the model rightly has no parameter for."""
    if model.pp is not None and not model.pp.owns(name):  # another pipeline stage's
        return True
    # Old Llama checkpoints saved RoPE's inv_freq; ours is recomputed from the config.
    if name.endswith("rotary_emb.inv_freq"):
        return True
    # A tied checkpoint may still store the (identical) output matrix.
    return name == "lm_head.weight" and model.config.tie_word_embeddings
