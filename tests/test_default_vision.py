"""The built-in vision model (tinyserve-vision): it ships in the package with a known fingerprint, its
language model is the built-in model's, weight for weight, it is served by its name with nothing
downloaded, its greedy tokens are transformers' own for the same image, and two images give two
answers. scripts/build_default_vision.py is its recipe and builds the same bytes again.
"""

import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

import tinyserve
from tests.llava_checkpoints import hf_chat_greedy, hf_greedy_with_images, image
from tests.pythons import ROOT
from tinyserve import LLM, SamplingParams
from tinyserve.models import default_model
from tinyserve.models.default_model import DEFAULT_VISION_FINGERPRINT, default_vision_path, model_fingerprint
from tinyserve.models.loader import resolve_model_path

PROMPT = "<|im_start|>user\n<image>\nWhat is in the picture?<|im_end|>\n<|im_start|>assistant\n"
ROWS_PER_IMAGE = 256  # (224 / 14)² patches, the class token dropped
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def llm():
    return LLM("tinyserve-vision")


def test_the_vision_model_ships_inside_the_package_with_its_fingerprint():
    folder = default_vision_path()
    assert folder.is_relative_to(next(iter(tinyserve.__path__)))
    assert {path.name for path in folder.iterdir()} == {
        "chat_template.jinja", "config.json", "generation_config.json", "model.safetensors", "processor_config.json",
        "tokenizer.json", "tokenizer_config.json"}
    assert model_fingerprint(folder) == DEFAULT_VISION_FINGERPRINT
    assert resolve_model_path("tinyserve-vision") == folder
    assert resolve_model_path("tinyserve-default") == default_model.default_model_path()


def test_its_language_model_is_the_built_in_model_with_a_zero_row_for_the_image_placeholder():
    language = load_file(default_model.default_model_path() / "model.safetensors")
    vision = load_file(default_vision_path() / "model.safetensors")
    embed = vision.pop("language_model.model.embed_tokens.weight")
    assert torch.equal(embed[:-1], language.pop("model.embed_tokens.weight"))
    assert not embed[-1].any()  # the placeholder's row, id 4096: never looked up, a logit of 0 when tied
    for name, tensor in language.items():
        assert torch.equal(vision["language_model." + name], tensor), name


def test_a_folder_of_that_name_comes_before_the_built_in_model(tmp_path, monkeypatch):
    (tmp_path / "tinyserve-vision").mkdir()
    (tmp_path / "tinyserve-vision" / "config.json").write_text("{}")
    monkeypatch.chdir(tmp_path)
    assert resolve_model_path("tinyserve-vision").resolve() == (tmp_path / "tinyserve-vision").resolve()


def test_its_greedy_tokens_are_transformers_and_two_images_give_two_answers(llm):
    images = [image(1, 300, 200), image(2, 224, 224)]
    outputs = llm.generate([{"prompt": PROMPT, "multi_modal_data": {"image": picture}} for picture in images],
                           SamplingParams(max_tokens=NEW_TOKENS, temperature=0))
    path = default_vision_path()
    for output, picture in zip(outputs, images):
        assert len(output.prompt_token_ids) == len(llm.get_tokenizer()(PROMPT).input_ids) - 1 + ROWS_PER_IMAGE
        assert list(output.outputs[0].token_ids) == hf_greedy_with_images(path, PROMPT, [picture], NEW_TOKENS)
    assert outputs[0].outputs[0].token_ids != outputs[1].outputs[0].token_ids


def test_a_chat_with_an_image_renders_with_its_template_as_transformers_processor_does(llm):
    picture = image(3)
    ours = llm.chat([{"role": "user", "content": [{"type": "image_pil", "image_pil": picture},
                                                  {"type": "text", "text": "Describe it."}]}],
                    SamplingParams(max_tokens=NEW_TOKENS, temperature=0))
    conversation = [{"role": "user", "content": [{"type": "image", "image": picture},
                                                 {"type": "text", "text": "Describe it."}]}]
    assert list(ours[0].outputs[0].token_ids) == hf_chat_greedy(default_vision_path(), conversation, NEW_TOKENS)


@pytest.mark.slow
def test_the_recipe_builds_the_shipped_bytes(tmp_path):
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "build_default_vision.py"), "--out",
                             str(tmp_path)], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert "(the shipped vision model)" in result.stdout
    assert model_fingerprint(tmp_path) == DEFAULT_VISION_FINGERPRINT
