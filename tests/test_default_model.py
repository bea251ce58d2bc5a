"""The built-in default model: built once into the cache, a valid Hugging Face
checkpoint, and trained enough that its greedy output is not one token repeated.

The real build (about a minute) happens once per test session, in a temporary cache.
"""

import json
import threading

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tinyserve.models import default_model
from tinyserve.models.default_model import default_cache_dir, default_model_path
from tinyserve.models.tokenizer import EOS_TOKEN, IM_END_TOKEN

FOLDER_NAME = f"default-model-v{default_model.DEFAULT_MODEL_VERSION}"


@pytest.fixture(scope="session")
def default_model_folder(tmp_path_factory):
    cache_dir = tmp_path_factory.mktemp("tinyserve-cache")
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setenv("TINYSERVE_CACHE_DIR", str(cache_dir))
        return default_model_path()


@pytest.fixture(scope="module")
def hf_model_and_tokenizer(default_model_folder):
    model = AutoModelForCausalLM.from_pretrained(default_model_folder, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(default_model_folder, local_files_only=True)
    return model.eval(), tokenizer


def fake_build(calls: list[str]):
    def build(folder):
        calls.append(str(folder))
        (folder / "config.json").write_text("{}")

    return build


def test_default_model_is_built_into_the_cache_folder(default_model_folder):
    assert default_model_folder.name == FOLDER_NAME
    files = {path.name for path in default_model_folder.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"} <= files
    assert [path.name for path in default_model_folder.parent.iterdir() if path.is_dir()] == [FOLDER_NAME]


def test_a_cached_default_model_is_not_built_again(default_model_folder, monkeypatch):
    monkeypatch.setenv("TINYSERVE_CACHE_DIR", str(default_model_folder.parent))
    calls = []
    monkeypatch.setattr(default_model, "build_default_model", fake_build(calls))
    assert default_model_path() == default_model_folder
    assert calls == []


def test_cache_folder_comes_from_tinyserve_cache_dir_then_xdg_then_home(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.delenv("TINYSERVE_CACHE_DIR", raising=False)
    assert default_cache_dir() == tmp_path / "home" / ".cache" / "tinyserve"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "xdg" / "tinyserve"
    monkeypatch.setenv("TINYSERVE_CACHE_DIR", str(tmp_path / "mine"))
    assert default_cache_dir() == tmp_path / "mine"


def test_concurrent_callers_build_the_model_once(monkeypatch, tmp_path):
    monkeypatch.setenv("TINYSERVE_CACHE_DIR", str(tmp_path))
    calls = []
    monkeypatch.setattr(default_model, "build_default_model", fake_build(calls))
    paths = []
    threads = [threading.Thread(target=lambda: paths.append(default_model_path())) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(calls) == 1
    assert paths == [tmp_path / FOLDER_NAME] * 4


def test_a_failed_build_leaves_no_folder_behind(monkeypatch, tmp_path):
    monkeypatch.setenv("TINYSERVE_CACHE_DIR", str(tmp_path))

    def failing_build(folder):
        (folder / "config.json").write_text("{}")
        raise RuntimeError("out of disk")

    monkeypatch.setattr(default_model, "build_default_model", failing_build)
    with pytest.raises(RuntimeError, match="out of disk"):
        default_model_path()
    assert [path for path in tmp_path.iterdir() if path.is_dir()] == []


def test_temporary_folders_of_a_builder_that_died_are_removed(monkeypatch, tmp_path):
    monkeypatch.setenv("TINYSERVE_CACHE_DIR", str(tmp_path))
    stale = tmp_path / f".{FOLDER_NAME}.tmp-died"
    stale.mkdir()
    monkeypatch.setattr(default_model, "build_default_model", fake_build([]))
    assert default_model_path() == tmp_path / FOLDER_NAME
    assert not stale.exists()


def test_default_model_is_a_small_llama_with_grouped_query_attention(default_model_folder, hf_model_and_tokenizer):
    model, tokenizer = hf_model_and_tokenizer
    config = json.loads((default_model_folder / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert config["num_attention_heads"] == 2 * config["num_key_value_heads"]
    assert config["tie_word_embeddings"] is True
    assert config["vocab_size"] == len(tokenizer) == default_model.VOCAB_SIZE
    assert config["eos_token_id"] == tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    generation_config = json.loads((default_model_folder / "generation_config.json").read_text())
    assert set(generation_config["eos_token_id"]) == set(tokenizer.convert_tokens_to_ids([EOS_TOKEN, IM_END_TOKEN]))
    assert 3_000_000 < sum(p.numel() for p in model.parameters()) < 6_000_000


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
