"""The image encoder of a LLaVA checkpoint: its CLIP vision tower and the projector into the language model.

    pixel_values [n, 3, H, W]
      ─ patch_embedding (a conv, stride = patch size) ─► [n, P, d]    P = (H / patch)²
      ─ the class embedding in front, + position embeddings, pre_layrnorm ─► [n, 1 + P, d]
      ─ encoder layers: x + attn(layer_norm1(x)), then x + mlp(layer_norm2(x))   (no mask: every patch
        sees every patch; mlp = fc2(act(fc1)), CLIP's quick_gelu)
      ─ the hidden states after layer `vision_feature_layer` (-2: the last but one), the class token
        dropped ("default" strategy; "full" keeps it)
      ─ multi_modal_projector: linear_2(act(linear_1)) ─► [n, P, text hidden size]

Each image's rows then stand in the prompt where its placeholder tokens are (layer.py). The arithmetic
is transformers' CLIPVisionModel's and LlavaMultiModalProjector's, so that the rows equal what
transformers' LlavaForConditionalGeneration merges (tests/test_multimodal.py). The tower runs only the
layers up to the selected one: the layers after it are loaded by no one and skipped.
"""

import pathlib

import torch
from torch import nn
from transformers.activations import ACT2FN


class CLIPVisionEncoderLayer(nn.Module):
    def __init__(self, hidden: int, intermediate: int, heads: int, eps: float, act: str) -> None:
        super().__init__()
        self.heads = heads
        self.layer_norm1 = nn.LayerNorm(hidden, eps=eps)
        self.layer_norm2 = nn.LayerNorm(hidden, eps=eps)
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(hidden, hidden) for _ in range(4))
        self.fc1, self.fc2 = nn.Linear(hidden, intermediate), nn.Linear(intermediate, hidden)
        self.act = ACT2FN[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, length, hidden = x.shape
        h = self.layer_norm1(x)
        q, k, v = (proj(h).view(n, length, self.heads, -1).transpose(1, 2)
                   for proj in (self.q_proj, self.k_proj, self.v_proj))
        attended = nn.functional.scaled_dot_product_attention(q, k, v)  # scale: head_dim ** -0.5, as CLIP's
        x = x + self.out_proj(attended.transpose(1, 2).reshape(n, length, hidden))
        return x + self.fc2(self.act(self.fc1(self.layer_norm2(x))))


class ImageEncoder(nn.Module):
    """CLIP's vision tower up to the selected layer, and LLaVA's projector."""

    def __init__(self, config) -> None:
        super().__init__()
        vision = config.vision_config
        layer = config.vision_feature_layer
        if not isinstance(layer, int):
            raise ValueError(f"vision_feature_layer {layer!r}: only one layer's features are supported")
        self.num_layers = layer % (vision.num_hidden_layers + 1)  # hidden_states[k]: the output of k layers
        self.keep_class_token = config.vision_feature_select_strategy == "full"
        self.patch_size = vision.patch_size
        d = vision.hidden_size
        self.class_embedding = nn.Parameter(torch.zeros(d))
        self.patch_embedding = nn.Conv2d(vision.num_channels, d, vision.patch_size, vision.patch_size, bias=False)
        self.position_embedding = nn.Embedding((vision.image_size // vision.patch_size) ** 2 + 1, d)
        self.pre_layrnorm = nn.LayerNorm(d, eps=vision.layer_norm_eps)
        self.layers = nn.ModuleList(
            CLIPVisionEncoderLayer(d, vision.intermediate_size, vision.num_attention_heads, vision.layer_norm_eps,
                                   vision.hidden_act) for _ in range(self.num_layers))
        text_hidden = config.text_config.hidden_size
        bias = getattr(config, "multimodal_projector_bias", True)
        self.linear_1 = nn.Linear(d, text_hidden, bias=bias)
        self.linear_2 = nn.Linear(text_hidden, text_hidden, bias=bias)
        self.projector_act = ACT2FN[config.projector_hidden_act]

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[n, 3, H, W] → [n, rows, text hidden size]: each image's rows, in the model's dtype."""
        dtype = self.patch_embedding.weight.dtype
        patches = self.patch_embedding(pixel_values.to(dtype)).flatten(2).transpose(1, 2)  # [n, P, d]
        cls = self.class_embedding.expand(patches.shape[0], 1, -1)
        x = torch.cat([cls, patches], dim=1) + self.position_embedding.weight[:patches.shape[1] + 1]
        x = self.pre_layrnorm(x)
        for layer in self.layers:
            x = layer(x)
        features = x if self.keep_class_token else x[:, 1:]
        return self.linear_2(self.projector_act(self.linear_1(features)))

    def checkpoint_name(self, name: str) -> str | None:
        """This module's parameter for a checkpoint tensor's name (vision_tower.[vision_model.]…,
        multi_modal_projector.…), or None: the language model's, or a layer past the selected one."""
        if name.startswith("multi_modal_projector."):
            return name.removeprefix("multi_modal_projector.")
        if not name.startswith("vision_tower."):
            return None
        name = name.removeprefix("vision_tower.").removeprefix("vision_model.")
        if name.startswith("encoder.layers."):
            index, rest = name.removeprefix("encoder.layers.").split(".", 1)
            if int(index) >= self.num_layers:
                return None
            return f"layers.{index}.{rest.removeprefix('self_attn.').removeprefix('mlp.')}"
        if name.startswith("post_layernorm."):  # after the last layer: never in the selected features
            return None
        return name.removeprefix("embeddings.")


def load_image_encoder(path, config, dtype: torch.dtype, device: torch.device) -> ImageEncoder:
    """The checkpoint's image encoder, every parameter filled from its safetensors (checked), in `dtype`."""
    from safetensors import safe_open

    from tinyserve.models.loader import checkpoint_files

    with torch.device(device):
        encoder = ImageEncoder(config).to(dtype)
    params = dict(encoder.named_parameters())
    loaded = set()
    for file in checkpoint_files(pathlib.Path(path)):
        with safe_open(file, framework="pt", device="cpu") as f:
            for hf_name in f.keys():
                name = encoder.checkpoint_name(hf_name)
                if name is None:
                    continue
                if name not in params or tuple(params[name].shape) != tuple(f.get_slice(hf_name).get_shape()):
                    raise ValueError(f"checkpoint {str(path)!r}: weight {hf_name!r} does not fit the image encoder")
                with torch.no_grad():
                    params[name].copy_(f.get_tensor(hf_name))
                loaded.add(name)
    if missing := sorted(set(params) - loaded):
        raise ValueError(f"checkpoint {str(path)!r} lacks the image encoder's weights {missing}")
    encoder.requires_grad_(False)
    return encoder.eval()
