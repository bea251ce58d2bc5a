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

A prompt may also be token ids with images (vLLM's {"prompt_token_ids": ..., "multi_modal_data": ...}):
each image's placeholder run already expanded, as a traced run logs it, or one placeholder an image.

Refused, each a 400 naming `multi_modal_data`: a model without images, a kind other than "image",
something that is not an image, more images than --limit-mm-per-prompt allows, a prompt whose
<image> markers do not match its images one for one, and token ids whose placeholders do not.

A traced run keeps each image it was given (keep_images), so that it can be replayed.
"""

import functools
import hashlib
import os
import threading

import numpy as np

from tinyserve.errors import InvalidInputError
from tinyserve.wire.messages import MultiModalFeature

FIELD = "multi_modal_data"
_kept: set = set()  # (folder, mm_hash) of each image this process has kept (keep_images)


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


def images_prompt(renderer, prompt: dict, add_special_tokens: bool = True,
                  truncation=None) -> tuple[str | None, list[int], list[MultiModalFeature]]:
    """frontend/render.py's Renderer.images_prompt: {"prompt": text} or {"prompt_token_ids": ids}, with its
    multi_modal_data, as its text (None for ids), its token ids and one feature an image."""
    info = renderer.model_info
    if info.image_token_id is None:
        raise InvalidInputError("this model takes no images: multi_modal_data needs an image-text checkpoint "
                                "(LlavaForConditionalGeneration)", FIELD)
    if truncation is not None or "prompt_embeds" in prompt or ("prompt_token_ids" in prompt) == ("prompt" in prompt):
        raise InvalidInputError("multi_modal_data goes with a text 'prompt' or with 'prompt_token_ids', one of them: "
                                "not with prompt_embeds or truncate_prompt_tokens", FIELD)
    images = images_of(prompt["multi_modal_data"], renderer.limit_images_per_prompt)
    if "prompt_token_ids" in prompt:
        token_ids = renderer.tokenize_prompt(list(prompt["prompt_token_ids"])).prompt_token_ids
        return None, *process_token_ids(info.path, info.image_token_id, token_ids, images)
    text = prompt["prompt"]
    if isinstance(text, str):
        renderer.check_text_fits(text)
    return text, *process(info.path, info.image_token_id, text, images, add_special_tokens)


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
    positions = [i for i, token in enumerate(token_ids) if token == image_token_id]
    per_image = len(positions) // len(images)
    starts = positions[::per_image]
    assert all(positions[k] == starts[k // per_image] + k % per_image for k in range(len(positions))), \
        "the processor expands each marker to one run"
    return token_ids, _features(images, out["pixel_values"], starts, per_image)


def process_token_ids(path, image_token_id: int, token_ids: list[int],
                      images: list) -> tuple[list[int], list[MultiModalFeature]]:
    """A prompt given as token ids with images (vLLM's {"prompt_token_ids": ..., "multi_modal_data": ...}): each
    image's placeholders already expanded (as a traced run logs them, so replay sends them back), or one
    placeholder token per image, which is expanded here as the processor expands a marker."""
    processor = _processor(str(path))
    if not images:
        raise InvalidInputError("multi_modal_data has no image for prompt_token_ids", FIELD)
    rows = processor(text=processor.image_token, images=[images[0].convert("RGB")],
                     return_tensors="np")["input_ids"][0].tolist().count(image_token_id)
    positions = [i for i, token in enumerate(token_ids) if token == image_token_id]
    if len(positions) == len(images) and rows > 1:  # one placeholder an image: expanded here
        for position in reversed(positions):
            token_ids = token_ids[:position] + [image_token_id] * rows + token_ids[position + 1:]
        positions = [i for i, token in enumerate(token_ids) if token == image_token_id]
    starts = positions[::rows]
    if len(positions) != rows * len(images) or any(
            positions[k] != starts[k // rows] + k % rows for k in range(len(positions))):
        raise InvalidInputError(f"prompt_token_ids has {len(positions)} image placeholder token(s) (id "
                                f"{image_token_id}) for {len(images)} image(s) of {rows} rows each: give each image "
                                f"one placeholder, or its {rows} in a run", FIELD)
    pixel_values = processor.image_processor([image.convert("RGB") for image in images],
                                             return_tensors="np")["pixel_values"]
    return list(token_ids), _features(images, pixel_values, starts, rows)


def _features(images: list, pixel_values, starts: list[int], rows: int) -> list[MultiModalFeature]:
    """One feature an image: its content hash, its placeholder run and its pixel values; each image kept by a
    traced run that keeps them (keep_images)."""
    pixel_values = np.ascontiguousarray(pixel_values, dtype=np.float32)
    features = [MultiModalFeature(mm_hash(image), start, rows, pixel_values[i].tobytes(), list(pixel_values[i].shape))
                for i, (image, start) in enumerate(zip(images, starts))]
    keep_images(images, [feature.identifier for feature in features])
    return features


def keep_images(images: list, hashes: list[str]) -> None:
    """Each image once, as <run>/images/<mm_hash>.<format>, where this process traces to a run that keeps its
    inputs (lifecycle/tracing.py's kept_images_dir): its spans log an image's hash, and replay reads its pixels back
    from here. An image a request sent as bytes (a data:, file: or http(s): URL) is kept as those bytes, which
    decode to the very pixels served; an offline PIL image is written as BMP where BMP holds its mode exactly (a
    copy of its pixels, no compression to pay for while the engine runs), else as uncompressed TIFF."""
    from tinyserve.lifecycle.tracing import kept_images_dir
    from tinyserve.multimodal.media import SOURCE_BYTES

    folder = kept_images_dir()
    if folder is None:
        return
    folder.mkdir(mode=0o700, exist_ok=True)
    for image, digest in zip(images, hashes):
        if (folder, digest) in _kept:  # this process's record, not a listing of a folder that only grows
            continue
        _kept.add((folder, digest))
        source = image.info.get(SOURCE_BYTES)
        suffix = (image.format or "img").lower() if source is not None else (
            "bmp" if image.mode in ("1", "L", "P", "RGB") else "tiff")
        partial = folder / f".{digest}.{os.getpid()}.{threading.get_ident()}"  # whole or absent, to a reader
        if source is not None:
            partial.write_bytes(source)
        else:
            image.save(partial, suffix.upper())
        os.replace(partial, folder / f"{digest}.{suffix}")
