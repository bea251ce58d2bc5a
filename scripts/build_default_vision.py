"""Build the built-in vision model that ships in tinyserve/models/default-vision/.

    .venv/bin/python scripts/build_default_vision.py                 rebuild it in place
    .venv/bin/python scripts/build_default_vision.py --out /tmp/v    build it elsewhere

The recipe of the model that `tinyserve/models/default_model.py` describes as the built-in
vision model: LLaVA (`LlavaForConditionalGeneration`) around the shipped built-in language
model, so that `LLM("tinyserve-vision")` and `tinyserve serve tinyserve-vision` take images
with nothing downloaded. It prints the fingerprint of what it built: the shipped one
(DEFAULT_VISION_FINGERPRINT) means nothing changed.

- The language model is the built-in model, weight for weight, with one more vocabulary row
  for "<image>" (id 4096), all zeros: the row an image's placeholder would look up is never
  read (the image's rows stand there instead), and a zero output row gives the placeholder a
  logit of 0, below the first choice of every step of a trained model.
- The vision tower is CLIP's, random (torch seed 2) and small: 224x224 images in 14x14 patches
  (256 rows an image, LLaVA-1.5's patch size at a quarter of its 336-pixel side), 3 layers of
  width 128, the features of the last but one (LLaVA's vision_feature_layer -2).
- The projector is LLaVA's two layers (GELU), random, its output scaled so that an image row
  has the size of a token embedding row: rows ten times larger would drown the text.
- The processor is transformers' LlavaProcessor: CLIP's resize, centre crop and normalisation,
  and the tokenizer above. Its chat template is the built-in model's ChatML, with an image part
  written "<image>" and a newline where it stands in the message.

It knows nothing of images: what it shows is the mechanics (an image's 256 placeholders, the
encoder before the prefill, its cache and budget), and that two images give two answers.
"""

import argparse
import shutil
import sys
from pathlib import Path

import numpy as np
import torch
from transformers import (CLIPImageProcessor, CLIPVisionConfig, GenerationConfig, LlamaConfig, LlamaForCausalLM,
                          LlavaConfig, LlavaForConditionalGeneration, LlavaProcessor, PreTrainedTokenizerFast)

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from a checkout that is not pip-installed
    sys.path.insert(0, str(ROOT))

from tinyserve.models import default_model  # noqa: E402

IMAGE_TOKEN = "<image>"
IMAGE_SIZE, PATCH_SIZE = 224, 14
VISION_HIDDEN, VISION_INTERMEDIATE, VISION_LAYERS, VISION_HEADS = 128, 512, 3, 4
SEED = 2

# The built-in model's ChatML (its tokenizer_config.json's), with a message's parts written in order: an image
# part as "<image>\n", a text part as its text. A template that loops over the parts is given them as parts, by
# tinyserve and by transformers' processor alike (frontend/chat_messages.py's chat_content_format).
VISION_CHAT_TEMPLATE = (
    "{%- for message in messages -%}{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'image' -%}{{- '<image>\\n' -}}{%- elif part['type'] == 'text' -%}{{- part['text'] -}}"
    "{%- endif -%}{%- endfor -%}{%- endif -%}{{- '<|im_end|>\\n' -}}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def build_default_vision(folder: Path, language_folder: Path) -> None:
    """Write the LLaVA checkpoint and its processor into `folder`, around the language model in `language_folder`."""
    tokenizer = PreTrainedTokenizerFast.from_pretrained(language_folder)
    tokenizer.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    image_token_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    tokenizer.chat_template = VISION_CHAT_TEMPLATE

    language = LlamaForCausalLM.from_pretrained(language_folder, dtype=torch.float32)
    text_config = LlamaConfig(**{**language.config.to_dict(), "vocab_size": len(tokenizer)})
    vision_config = CLIPVisionConfig(hidden_size=VISION_HIDDEN, intermediate_size=VISION_INTERMEDIATE,
                                     num_hidden_layers=VISION_LAYERS, num_attention_heads=VISION_HEADS,
                                     image_size=IMAGE_SIZE, patch_size=PATCH_SIZE)
    config = LlavaConfig(vision_config=vision_config, text_config=text_config, image_token_index=image_token_id,
                         vision_feature_layer=-2, vision_feature_select_strategy="default",
                         projector_hidden_act="gelu", tie_word_embeddings=True)
    torch.manual_seed(SEED)
    torch.set_num_threads(1)  # the same bytes on any number of cores
    model = LlavaForConditionalGeneration(config).eval()

    state = language.model.state_dict()
    embed = state["embed_tokens.weight"]
    state["embed_tokens.weight"] = torch.cat([embed, embed.new_zeros(len(tokenizer) - len(embed), embed.shape[1])])
    model.model.language_model.load_state_dict(state)
    model.tie_weights()

    processor = LlavaProcessor(
        image_processor=CLIPImageProcessor(size={"shortest_edge": IMAGE_SIZE},
                                           crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}),
        tokenizer=tokenizer, patch_size=PATCH_SIZE, vision_feature_select_strategy="default",
        num_additional_image_tokens=1, image_token=IMAGE_TOKEN, chat_template=VISION_CHAT_TEMPLATE)
    _scale_projector(model, processor, embed)

    model.generation_config = GenerationConfig(**GenerationConfig.from_pretrained(language_folder).to_diff_dict())
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    processor.save_pretrained(folder)


def _scale_projector(model, processor, embed: torch.Tensor) -> None:
    """Scale the projector's last layer so that an image row's RMS is a token embedding row's."""
    rng = np.random.default_rng(SEED)
    images = [(rng.random((IMAGE_SIZE, IMAGE_SIZE, 3)) * 255).astype("uint8") for _ in range(4)]
    pixels = processor.image_processor(images, return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        rows = model.model.get_image_features(pixel_values=pixels, vision_feature_layer=-2,
                                              vision_feature_select_strategy="default")
        rows = torch.cat(list(rows)) if isinstance(rows, (list, tuple)) else rows
        if hasattr(rows, "pooler_output"):
            rows = rows.pooler_output
        rows = torch.cat(list(rows)) if isinstance(rows, (list, tuple)) else rows
        factor = embed.pow(2).mean().sqrt() / rows.pow(2).mean().sqrt()
        projector = model.model.multi_modal_projector.linear_2
        projector.weight.mul_(factor)
        projector.bias.mul_(factor)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None,
                        help="where to write it (default: in place, tinyserve/models/default-vision/)")
    args = parser.parse_args()
    out = args.out or default_model.DEFAULT_VISION_PATH
    if out.exists() and args.out is None:
        shutil.rmtree(out)
    build_default_vision(out, default_model.default_model_path())
    fingerprint = default_model.model_fingerprint(out)
    same = ("the shipped vision model" if fingerprint == default_model.DEFAULT_VISION_FINGERPRINT
            else "a new vision model")
    print(f"{out}: fingerprint {fingerprint} ({same})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
