"""The render stage's part of images: a prompt's `multi_modal_data` through the checkpoint's own processor.

    {"prompt": "USER: <image>\\nWhat is this? ASSISTANT:", "multi_modal_data": {"image": PIL.Image or a list}}
      ─ transformers' AutoProcessor (LlavaProcessor: the image resized, cropped and normalised by its
        image processor; each <image> in the text expanded to as many placeholder tokens as the image
        encoder gives it rows) ─► prompt_token_ids, pixel_values [n, 3, H, W]
      ─ one MultiModalFeature per image (wire/messages.py): its content hash (vLLM's mm_hash, the
        SHA-256 of its mode, size and pixels), its placeholder run (offset, length), its pixel values

What the processor library does for us: the resizing, cropping and normalisation each checkpoint
was trained with, and the count of placeholder tokens, read from the checkpoint's own
processor_config.json, so that the prompt is token for token what transformers' model sees.

Refused, each a 400 naming `multi_modal_data`: a model without images, a kind other than "image",
something that is not an image, more images than --limit-mm-per-prompt allows, and a prompt whose
<image> markers do not match its images one for one.
"""

import functools
import hashlib

import numpy as np

from tinyserve.errors import InvalidInputError
from tinyserve.wire.messages import MultiModalFeature

FIELD = "multi_modal_data"


@functools.cache
def _processor(path: str):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(path)


def processor_chat_template(path) -> str | None:
    """The checkpoint's chat template as its processor has it (an image-text checkpoint keeps it there), or None."""
    return getattr(_processor(str(path)), "chat_template", None)


def image_marker(path) -> str:
    """The text that stands for one image in a prompt ("<image>" for LLaVA): the processor expands each one."""
    return _processor(str(path)).image_token


def mm_hash(image) -> str:
    """The image's content hash: two requests with the same pixels share its encoder output and its KV blocks."""
    digest = hashlib.sha256(f"{image.mode}\x00{image.size}\x00".encode())
    digest.update(image.tobytes())
    return digest.hexdigest()


def images_of(multi_modal_data, limit: int | None) -> list:
    """The prompt's images, checked: {"image": one or a list} and nothing else."""
    from PIL import Image

    if not isinstance(multi_modal_data, dict) or set(multi_modal_data) - {"image"}:
        kinds = sorted(multi_modal_data) if isinstance(multi_modal_data, dict) else type(multi_modal_data).__name__
        raise InvalidInputError(f"multi_modal_data takes {{'image': an image or a list of images}}; got {kinds}",
                                FIELD)
    images = multi_modal_data.get("image", [])
    images = images if isinstance(images, (list, tuple)) else [images]
    for i, image in enumerate(images):
        if not isinstance(image, Image.Image):
            raise InvalidInputError(f"multi_modal_data['image'][{i}] must be a PIL image, got {type(image).__name__}",
                                    FIELD)
    if limit is not None and len(images) > limit:
        raise InvalidInputError(f"multi_modal_data has {len(images)} images, more than the {limit} a prompt may "
                                f"carry (--limit-mm-per-prompt)", FIELD)
    return list(images)


def process(path, image_token_id: int, text: str, images: list,
            add_special_tokens: bool = True) -> tuple[list[int], list[MultiModalFeature]]:
    """The prompt's token ids, placeholders expanded, and one feature per image, in prompt order."""
    if not isinstance(text, str) or not text:
        raise InvalidInputError("a prompt with multi_modal_data needs its text as 'prompt' (its <image> markers "
                                "say where each image goes)", FIELD)
    processor = _processor(str(path))
    marker = processor.image_token
    if text.count(marker) != len(images):
        raise InvalidInputError(f"the prompt has {text.count(marker)} {marker} marker(s) for {len(images)} "
                                f"image(s) in multi_modal_data: one marker per image", FIELD)
    if not images:
        token_ids = processor.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]
        return list(token_ids), []
    out = processor(text=text, images=[image.convert("RGB") for image in images], return_tensors="np",
                    add_special_tokens=add_special_tokens)
    token_ids = out["input_ids"][0].tolist()
    pixel_values = np.ascontiguousarray(out["pixel_values"], dtype=np.float32)
    positions = [i for i, token in enumerate(token_ids) if token == image_token_id]
    per_image = len(positions) // len(images)
    features = []
    for i, image in enumerate(images):
        run = positions[i * per_image:(i + 1) * per_image]
        assert run and run[-1] - run[0] + 1 == per_image, "the processor expands each marker to one run"
        features.append(MultiModalFeature(mm_hash(image), run[0], per_image, pixel_values[i].tobytes(),
                                          list(pixel_values[i].shape)))
    return token_ids, features
