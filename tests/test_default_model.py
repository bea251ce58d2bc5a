"""The built-in default model: its files ship in the package with a known fingerprint,
it is a valid Hugging Face checkpoint, and it is trained enough that its greedy output
is not one token repeated. Its recipe, scripts/build_default_model.py, builds the same
model under every supported Python that has the build's libraries (about a minute a build).
"""

import json
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import tinyserve
from tests.pythons import ROOT, THIS_PYTHON, find_pythons, has_modules
from tinyserve.models import default_model
from tinyserve.models.default_model import DEFAULT_MODEL_FINGERPRINT, default_model_path, model_fingerprint
from tinyserve.models.tokenizer import EOS_TOKEN, IM_END_TOKEN

BUILD_SCRIPT = ROOT / "scripts" / "build_default_model.py"
BUILD_MODULES = ["torch", "transformers", "tokenizers", "safetensors"]
OTHER_BUILDERS = {v: p for v, p in find_pythons().items() if v != THIS_PYTHON and has_modules(p, BUILD_MODULES)}


@pytest.fixture(scope="module")
def hf_model_and_tokenizer():
    model = AutoModelForCausalLM.from_pretrained(default_model_path(), local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(default_model_path(), local_files_only=True)
    return model.eval(), tokenizer


def build_with(python: str, folder) -> str:
    """Run the recipe under `python` into `folder`; the fingerprint of what it built."""
    result = subprocess.run([python, str(BUILD_SCRIPT), "--out", str(folder)], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    # it shows how far the training is, from the first step to the last
    progress = [line for line in result.stderr.splitlines() if line.startswith("training step ")]
    assert progress[0].startswith("training step 1/") and progress[-1].startswith("training step 300/300: loss ")
    return model_fingerprint(folder)


def test_default_model_ships_inside_the_package():
    folder = default_model_path()
    assert folder.is_relative_to(next(iter(tinyserve.__path__)))
    files = {path.name for path in folder.iterdir()}
    assert files == {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                     "tokenizer_config.json"}


def test_shipped_model_has_the_recorded_fingerprint():
    assert model_fingerprint(default_model_path()) == DEFAULT_MODEL_FINGERPRINT


def test_missing_model_files_are_named_with_a_way_out(monkeypatch, tmp_path):
    monkeypatch.setattr(default_model, "DEFAULT_MODEL_PATH", tmp_path)
    with pytest.raises(FileNotFoundError, match="build_default_model.py"):
        default_model_path()


def test_default_model_is_a_small_llama_with_grouped_query_attention(hf_model_and_tokenizer):
    model, tokenizer = hf_model_and_tokenizer
    config = json.loads((default_model_path() / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert config["num_attention_heads"] == 2 * config["num_key_value_heads"]
    assert config["tie_word_embeddings"] is True
    assert config["vocab_size"] == len(tokenizer) == 4096
    assert config["eos_token_id"] == tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    generation_config = json.loads((default_model_path() / "generation_config.json").read_text())
    assert set(generation_config["eos_token_id"]) == set(tokenizer.convert_tokens_to_ids([EOS_TOKEN, IM_END_TOKEN]))
    assert 3_000_000 < sum(p.numel() for p in model.parameters()) < 6_000_000
    assert {p.dtype for p in model.parameters()} == {torch.float32}


@pytest.mark.parametrize("prompt", ["The", "Return a list of", "If the queue is"])
def test_greedy_output_is_varied_text(hf_model_and_tokenizer, prompt):
    model, tokenizer = hf_model_and_tokenizer
    input_ids = torch.tensor([tokenizer.encode(prompt)])
    with torch.no_grad():
        output = model.generate(input_ids, max_new_tokens=30, min_new_tokens=30, do_sample=False)
    new_ids = output[0, input_ids.shape[1] :].tolist()
    assert len(new_ids) == 30
    assert len(set(new_ids)) >= 8


def test_in_a_chat_the_model_answers_and_ends_its_turn(hf_model_and_tokenizer):
    model, tokenizer = hf_model_and_tokenizer
    messages = [{"role": "user", "content": "Beautiful is better than ugly."}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    input_ids = prompt["input_ids"]
    with torch.no_grad():
        output = model.generate(input_ids, max_new_tokens=40, do_sample=False)
    new_ids = output[0, input_ids.shape[1] :].tolist()
    assert new_ids[-1] == tokenizer.convert_tokens_to_ids(IM_END_TOKEN)
    assert len(tokenizer.decode(new_ids, skip_special_tokens=True).split()) >= 3


@pytest.fixture(scope="module")
def fingerprint_built_here(tmp_path_factory):
    return build_with(sys.executable, tmp_path_factory.mktemp("built-here"))


@pytest.mark.slow  # about a minute a build, and one here to compare with
@pytest.mark.parametrize("version", sorted(OTHER_BUILDERS) or [
    pytest.param(None, marks=pytest.mark.skip(reason="no other supported Python here has " + ", ".join(BUILD_MODULES)))
])
def test_the_model_built_under_another_python_is_the_same(version, fingerprint_built_here, tmp_path):
    assert build_with(OTHER_BUILDERS[version], tmp_path) == fingerprint_built_here
