"""Tiny random-weight LLaVA checkpoints, with their processor, built by transformers (a helper module, not tests).

`LlavaForConditionalGeneration` after a fixed seed: a CLIP vision tower of 2 layers over 30x30
images in 6x6 patches (25 rows an image, the class token dropped), LLaVA's two-layer projector,
and a Llama language model of tiny_checkpoints' odd shapes (head_dim 24, grouped-query attention,
initializer_range 0.3 so that greedy decoding wanders). The processor is transformers' own
LlavaProcessor over a CLIPImageProcessor (resize, centre crop, normalise) and the tiny tokenizer
with "<image>" added. Saved the way the hub stores them, so that what tinyserve computes is compared
with what transformers computes on the same files.

    path = llava_checkpoint()          built once per process
"""

import functools
import pathlib
import tempfile

import numpy as np
import torch

from tests.tiny_tokenizer import TINY_VOCAB_SIZE, tiny_tokenizer

IMAGE_SIZE, PATCH_SIZE = 30, 6
ROWS_PER_IMAGE = (IMAGE_SIZE // PATCH_SIZE) ** 2
_dirs: list[tempfile.TemporaryDirectory] = []


@functools.cache
def llava_checkpoint(vision_feature_layer: int = -2, strategy: str = "default") -> pathlib.Path:
    from tokenizers import AddedToken, Tokenizer
    from transformers import (CLIPImageProcessor, CLIPVisionConfig, LlamaConfig, LlavaConfig,
                              LlavaForConditionalGeneration, LlavaProcessor, PreTrainedTokenizerFast)

    tokenizer = Tokenizer.from_str(tiny_tokenizer(TINY_VOCAB_SIZE).to_str())  # a copy: the cached one is shared
    tokenizer.add_tokens([AddedToken("<image>", special=True)])
    image_token_id = tokenizer.token_to_id("<image>")
    text = LlamaConfig(vocab_size=tokenizer.get_vocab_size(), hidden_size=64, intermediate_size=128,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=24,
                       max_position_embeddings=512, initializer_range=0.3, eos_token_id=None, bos_token_id=None)
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
                              image_size=IMAGE_SIZE, patch_size=PATCH_SIZE, projection_dim=16)
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_index=image_token_id,
                         vision_feature_layer=vision_feature_layer, vision_feature_select_strategy=strategy,
                         projector_hidden_act="gelu")
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(config).eval()
    folder = tempfile.TemporaryDirectory(prefix="tinyserve-llava-")
    _dirs.append(folder)
    path = pathlib.Path(folder.name)
    model.save_pretrained(path)
    processor = LlavaProcessor(
        image_processor=CLIPImageProcessor(size={"shortest_edge": IMAGE_SIZE},
                                           crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}),
        tokenizer=PreTrainedTokenizerFast(tokenizer_object=tokenizer), patch_size=PATCH_SIZE,
        vision_feature_select_strategy=strategy, num_additional_image_tokens=1, image_token="<image>")
    processor.chat_template = LLAVA_CHAT_TEMPLATE
    processor.save_pretrained(path)
    return path


# llava-hf/llava-1.5-*-hf's template (its generation markers left out): a message's images, then its text
LLAVA_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] != 'system' %}{{ message['role'].upper() + ': '}}{% endif %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}{{ '<image>\n' }}{% endfor %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}{{ content['text'] + ' '}}"
    "{% endfor %}{% endfor %}{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}")


def image(seed: int, width: int = 40, height: int = 50):
    """A PIL image of random pixels, fixed by its seed."""
    from PIL import Image

    return Image.fromarray((np.random.default_rng(seed).random((height, width, 3)) * 255).astype("uint8"))


def hf_greedy_with_images(path: pathlib.Path, prompt: str, images: list, max_new_tokens: int) -> list[int]:
    """transformers' greedy tokens for a prompt with images, through the checkpoint's own processor."""
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(path)
    model = hf_llava(str(path))
    inputs = processor(text=prompt, images=images or None, return_tensors="pt")
    with torch.no_grad():
        generated = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return generated[0, inputs["input_ids"].shape[1]:].tolist()


def hf_chat_greedy(path: pathlib.Path, conversation: list[dict], max_new_tokens: int) -> list[int]:
    """transformers' greedy tokens for a chat whose image parts are {"type": "image", "image": PIL image}: the
    processor's own chat template and images (apply_chat_template), then generate."""
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(path)
    inputs = processor.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True, return_dict=True,
                                           return_tensors="pt")
    with torch.no_grad():
        generated = hf_llava(str(path)).generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return generated[0, inputs["input_ids"].shape[1]:].tolist()


@functools.cache
def hf_llava(path: str):
    from transformers import LlavaForConditionalGeneration

    return LlavaForConditionalGeneration.from_pretrained(path).eval()
