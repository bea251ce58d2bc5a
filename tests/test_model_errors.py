"""What a model that cannot be served is told: a path is never sent to `hf download`, a hub id is, and a
checkpoint of another architecture is named, with the ones tinyserve serves.

Each message reaches the command line as one line starting `error:` (cli/main.py and the commands print
ValueError so), whether the model was a path or a hub id.
"""

import json

import huggingface_hub
import pytest

from tinyserve.cli.main import main
from tinyserve.config import EngineArgs, ModelInfo
from tinyserve.models.loader import resolve_model_path

# The config.json of Qwen/Qwen2-VL-2B-Instruct, less most of it: an image-text architecture tinyserve does not
# serve (LLaVA over a Llama it does: tests/test_multimodal.py).
QWEN2_VL_CONFIG = {"architectures": ["Qwen2VLForConditionalGeneration"], "model_type": "qwen2_vl",
                   "vocab_size": 151936, "vision_config": {"depth": 32}}
# A LLaVA whose language model is one tinyserve does not serve: refused, naming the model_type.
LLAVA_OVER_GEMMA = {"architectures": ["LlavaForConditionalGeneration"], "model_type": "llava",
                    "text_config": {"model_type": "gemma", "vocab_size": 256000},
                    "vision_config": {"model_type": "siglip_vision_model"}}
SUPPORTED = ("LlamaForCausalLM (llama)", "MistralForCausalLM (mistral)", "Qwen2ForCausalLM (qwen2)",
             "Qwen3ForCausalLM (qwen3)", "LlavaForConditionalGeneration (llava) over one of them")


@pytest.fixture(autouse=True)
def empty_hub_cache(tmp_path, monkeypatch):
    cache = tmp_path / "hub-cache"
    cache.mkdir()
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))


@pytest.mark.parametrize("model", ["/models/Qwen3-0.6B", "./models/qwen", "~/no-such-model", "models/qwen/extra"])
def test_a_path_that_is_not_there_is_told_so_without_hf_download(model):
    with pytest.raises(ValueError) as error:
        resolve_model_path(model)
    message = str(error.value)
    assert message.startswith(f"model {model!r}: no such folder;")
    assert "hf download" not in message and "config.json" in message


def test_a_file_is_not_a_checkpoint_folder(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF")
    with pytest.raises(ValueError, match="is a file, not a checkpoint folder") as error:
        resolve_model_path(str(path))
    assert "hf download" not in str(error.value)


def test_a_folder_without_config_is_not_a_model(tmp_path):
    with pytest.raises(ValueError, match="has no config.json, so it is not a model") as error:
        resolve_model_path(str(tmp_path))
    assert "hf download" not in str(error.value)


def test_a_hub_id_not_in_the_cache_is_told_how_to_fetch_it():
    with pytest.raises(ValueError) as error:
        resolve_model_path("Qwen/Qwen3-0.6B")
    assert str(error.value).endswith("tinyserve never downloads; fetch it first: hf download Qwen/Qwen3-0.6B")


def test_what_is_neither_a_folder_nor_a_hub_id_is_told_so():
    with pytest.raises(ValueError, match="no such folder, and not a valid hub id") as error:
        resolve_model_path("not a model")
    assert "hf download" not in str(error.value)


def checkpoint_folder(tmp_path, name: str, config: dict):
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("config, named", [(QWEN2_VL_CONFIG, ("Qwen2VLForConditionalGeneration", "'qwen2_vl'")),
                                           (LLAVA_OVER_GEMMA, ("LlavaForConditionalGeneration", "'llava'"))])
def test_a_checkpoint_of_another_architecture_names_it_and_the_supported_ones(tmp_path, config, named):
    folder = checkpoint_folder(tmp_path, "checkpoint", config)
    with pytest.raises(ValueError) as error:
        ModelInfo.from_args(EngineArgs(model=str(folder)))
    message = str(error.value)
    assert all(name in message for name in named) and "does not serve" in message
    for supported in SUPPORTED:
        assert supported in message


def test_a_config_without_architectures_names_its_model_type(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "vocab_size": 50257}))
    with pytest.raises(ValueError, match="holds a checkpoint of model_type 'gpt2', which tinyserve does not serve"):
        ModelInfo.from_args(EngineArgs(model=str(tmp_path)))


def command_error(capsys, *argv: str) -> str:
    """The one `error:` line a command printed (serve also logs INFO lines to stderr)."""
    status = main(list(argv))
    assert status in (1, 2)
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line.lower()]
    assert len(errors) == 1, errors
    return errors[0]


def test_on_the_command_line_path_hub_id_and_architecture_errors_all_start_error(tmp_path, capsys):
    path_error = command_error(capsys, "serve", "/models/Qwen3-0.6B", "--port", "0")
    hub_error = command_error(capsys, "serve", "Qwen/Qwen3-0.6B", "--port", "0")
    folder = checkpoint_folder(tmp_path, "Qwen2-VL-2B-Instruct", QWEN2_VL_CONFIG)
    architecture_error = command_error(capsys, "serve", str(folder), "--port", "0")
    assert path_error.startswith("error: model '/models/Qwen3-0.6B': no such folder;")
    assert hub_error.startswith("error: model 'Qwen/Qwen3-0.6B': no such folder, and not a hub id")
    assert architecture_error.startswith(f"error: {folder} holds a Qwen2VLForConditionalGeneration")
    assert "Traceback" not in path_error + hub_error + architecture_error
