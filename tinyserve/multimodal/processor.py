"""The render stage's part of images: a prompt's `multi_modal_data` through the checkpoint's own processor.

    {"prompt": "USER: <image>\\nWhat is this? ASSISTANT:", "multi_modal_data": {"image": PIL.Image or a list}}
      ─ transformers' AutoProcessor (LlavaProcessor: the image resized, cropped and normalised by its
        image processor; each <image> in the text expanded to as many placeholder tokens as the image
        encoder gives it rows) ─► prompt_token_ids, pixel_values [n, 3, H, W]
      ─ one MultiModalFeature per image (wire/messages.py): its content hash (vLLM's mm_hash, the
        SHA-256 of its mode, size and pixels), its placeholder run (offset, length), its pixel values

What the processor library does for us: the resizing, cropping and normalisation each checkpoint
was trained with, and the count of placeholder tokens, read from the checkpoint's own
processor_config.json, so that the prompt is token for token what transformers' model sees. Its
output for an image is kept by content hash (ProcessorCache, vLLM's processor cache): the same image
again is not processed again.

A prompt may also be token ids with images (vLLM's {"prompt_token_ids": ..., "multi_modal_data": ...}):
each image's placeholder run already expanded, as a traced run logs it, or one placeholder an image.

Refused, each a 400 naming `multi_modal_data`: a model without images, a kind other than "image",
something that is not an image, more images than --limit-mm-per-prompt allows, a prompt whose
<image> markers do not match its images one for one, and token ids whose placeholders do not.

A traced run keeps each image it was given (keep_images), so that it can be replayed.
"""

import collections
import functools
import hashlib
import logging
import os
import threading

import numpy as np

from tinyserve.errors import InvalidInputError
from tinyserve.wire.messages import MultiModalFeature

FIELD = "multi_modal_data"
logger = logging.getLogger(__name__)
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


class ProcessorCache:
    """vLLM's multi-modal processor cache: an image's processed pixel values and placeholder count, by checkpoint
    and content hash, so that the same image in a later request skips the processor's resize, crop and
    normalisation (a quarter of an image chat's time to first token on the built-in vision model: BENCHMARKS.md).
    At most MAX_BYTES of pixel values (vLLM's --mm-processor-cache-gb default, 4 GiB), least recently used out
    first. Render threads share it, under a lock; the processor itself runs outside it."""

    MAX_BYTES = 4 << 30

    def __init__(self, max_bytes: int = MAX_BYTES) -> None:
        self.max_bytes, self.bytes = max_bytes, 0
        self.entries: collections.OrderedDict = collections.OrderedDict()
        self.queries = self.hits = 0
        self.lock = threading.Lock()

    def processed(self, path, image_token_id: int, image, digest: str) -> tuple[np.ndarray, int]:
        """(pixel values [3, H, W], placeholder tokens) of the image: the cache's, or the processor's now."""
        key = (str(path), digest)
        with self.lock:
            self.queries += 1
            if key in self.entries:
                self.hits += 1
                self.entries.move_to_end(key)
                return self.entries[key]
        processor = _processor(str(path))
        out = processor(text=processor.image_token, images=[image.convert("RGB")], return_tensors="np")
        entry = (np.ascontiguousarray(out["pixel_values"][0], dtype=np.float32),
                 out["input_ids"][0].tolist().count(image_token_id))
        with self.lock:
            if key not in self.entries:
                self.entries[key] = entry
                self.bytes += entry[0].nbytes
            while self.bytes > self.max_bytes and len(self.entries) > 1:
                self.bytes -= self.entries.popitem(last=False)[1][0].nbytes
        return entry


PROCESSOR_CACHE = ProcessorCache()


def process(path, image_token_id: int, text: str, images: list,
            add_special_tokens: bool = True) -> tuple[list[int], list[MultiModalFeature]]:
    """The prompt's token ids, placeholders expanded, and one feature per image, in prompt order: the text
    tokenized, each marker (one special token) then expanded to its image's placeholders, as the processor
    expands the marker in the text before it tokenizes (the marker's token splits the text either way)."""
    if not isinstance(text, str) or not text:
        raise InvalidInputError("a prompt with multi_modal_data needs its text as 'prompt' (its <image> markers "
                                "say where each image goes)", FIELD)
    processor = _processor(str(path))
    marker = processor.image_token
    if text.count(marker) != len(images):
        raise InvalidInputError(f"the prompt has {text.count(marker)} {marker} marker(s) for {len(images)} "
                                f"image(s) in multi_modal_data: one marker per image", FIELD)
    token_ids = list(processor.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])
    if not images:
        return token_ids, []
    return _expanded(path, image_token_id, token_ids, images, "the prompt's text")


def process_token_ids(path, image_token_id: int, token_ids: list[int],
                      images: list) -> tuple[list[int], list[MultiModalFeature]]:
    """A prompt given as token ids with images (vLLM's {"prompt_token_ids": ..., "multi_modal_data": ...}): each
    image's placeholders already expanded (as a traced run logs them, so replay sends them back), or one
    placeholder token per image, which is expanded here as the processor expands a marker."""
    if not images:
        raise InvalidInputError("multi_modal_data has no image for prompt_token_ids", FIELD)
    return _expanded(path, image_token_id, list(token_ids), images, "prompt_token_ids")


def _expanded(path, image_token_id: int, token_ids: list[int], images: list,
              where: str) -> tuple[list[int], list[MultiModalFeature]]:
    """The token ids with each image's placeholder run (one placeholder an image expanded to its run; a run
    already whole kept), and the images' features."""
    hashes = [mm_hash(image) for image in images]
    processed = [PROCESSOR_CACHE.processed(path, image_token_id, image, h) for image, h in zip(images, hashes)]
    rows = [n for _, n in processed]
    positions = [i for i, token in enumerate(token_ids) if token == image_token_id]
    if len(positions) == len(images) and rows != [1] * len(images):  # one placeholder an image: expanded here
        for position, n in zip(reversed(positions), reversed(rows)):
            token_ids[position:position + 1] = [image_token_id] * n
        positions = [i for i, token in enumerate(token_ids) if token == image_token_id]
    starts = [positions[sum(rows[:k])] if len(positions) == sum(rows) else -1 for k in range(len(images))]
    if len(positions) != sum(rows) or any(positions[sum(rows[:k]) + j] != start + j
                                          for k, start in enumerate(starts) for j in range(rows[k])):
        raise InvalidInputError(f"{where} has {len(positions)} image placeholder token(s) (id {image_token_id}) for "
                                f"{len(images)} image(s) of {rows} rows: give each image one placeholder, or its "
                                f"rows in a run", FIELD)
    features = [MultiModalFeature(digest, start, n, pixels.tobytes(), list(pixels.shape))
                for digest, start, (pixels, n) in zip(hashes, starts, processed)]
    keep_images(images, hashes)
    return token_ids, features


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
        try:
            if source is not None:
                partial.write_bytes(source)
            else:
                image.save(partial, suffix.upper())
            os.replace(partial, folder / f"{digest}.{suffix}")
        except (OSError, ValueError) as error:  # the run loses a replay, the request nothing
            _kept.discard((folder, digest))
            partial.unlink(missing_ok=True)
            logger.warning("could not keep image %s in %s: %s", digest[:12], folder, error)
