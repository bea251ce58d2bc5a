"""The built-in draft model: the built-in model's companion for speculative decoding. Its
files ship in the package with a known fingerprint, it shares the built-in model's
tokenizer exactly (a drafted id must mean the same token to the model that verifies it),
it is a valid Hugging Face checkpoint several times smaller than the built-in model, and
it predicts the built-in model's greedy tokens often enough to be worth drafting with.
scripts/build_default_model.py --draft is its recipe; scripts/measure_default_draft.py
measures it at length.
"""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

import tinyserve
from tinyserve.models import default_model
from tinyserve.models.default_model import (
    DEFAULT_DRAFT_FINGERPRINT,
    default_draft_path,
    default_model_path,
    model_fingerprint,
)
from tinyserve.models.tokenizer import BOS_TOKEN, EOS_TOKEN, IM_END_TOKEN, IM_START_TOKEN, PAD_TOKEN

# Greedy agreement along the built-in model's own greedy generations of these prompts was
# 54/104 = 0.52 when the shipped draft was built; a broken or untrained draft agrees on almost nothing.
AGREEMENT_FLOOR = 0.4
PROMPTS = [
    "The",
    "Return a list of",
    "If the queue is",
    "Context manager",
    "<|im_start|>user\nBeautiful is better than ugly.<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nErrors should never pass silently.<|im_end|>\n<|im_start|>assistant\n",
]
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def models():
    load = {"local_files_only": True, "dtype": torch.float32}
    target = AutoModelForCausalLM.from_pretrained(default_model_path(), **load).eval()
    draft = AutoModelForCausalLM.from_pretrained(default_draft_path(), **load).eval()
    return target, draft


def test_default_draft_ships_inside_the_package():
    folder = default_draft_path()
    assert folder.is_relative_to(next(iter(tinyserve.__path__)))
    files = {path.name for path in folder.iterdir()}
    assert files == {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    }


def test_shipped_draft_has_the_recorded_fingerprint():
    assert model_fingerprint(default_draft_path()) == DEFAULT_DRAFT_FINGERPRINT


def test_missing_draft_files_are_named_with_a_way_out(monkeypatch, tmp_path):
    monkeypatch.setattr(default_model, "DEFAULT_DRAFT_PATH", tmp_path)
    with pytest.raises(FileNotFoundError, match=r"build_default_model.py --draft"):
        default_draft_path()


def test_draft_shares_the_built_in_models_tokenizer_exactly():
    draft, target = default_draft_path(), default_model_path()
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (draft / name).read_bytes() == (target / name).read_bytes(), name
    draft_config = json.loads((draft / "config.json").read_text())
    target_config = json.loads((target / "config.json").read_text())
    for key in ("vocab_size", "bos_token_id", "eos_token_id", "pad_token_id", "tie_word_embeddings"):
        assert draft_config[key] == target_config[key], key
    draft_tokenizer = AutoTokenizer.from_pretrained(draft, local_files_only=True)
    target_tokenizer = AutoTokenizer.from_pretrained(target, local_files_only=True)
    assert len(draft_tokenizer) == len(target_tokenizer) == draft_config["vocab_size"] == 4096
    specials = [BOS_TOKEN, EOS_TOKEN, IM_START_TOKEN, IM_END_TOKEN, PAD_TOKEN]
    assert draft_tokenizer.convert_tokens_to_ids(specials) == target_tokenizer.convert_tokens_to_ids(specials)
    assert draft_tokenizer.chat_template == target_tokenizer.chat_template


def test_draft_is_a_llama_several_times_smaller_than_the_built_in_model(models):
    target, draft = models
    assert draft.config.model_type == "llama"
    assert draft.config.num_hidden_layers < target.config.num_hidden_layers
    assert draft.config.hidden_size < target.config.hidden_size
    draft_parameters = sum(p.numel() for p in draft.parameters())
    assert draft_parameters * 4 < sum(p.numel() for p in target.parameters())
    assert {p.dtype for p in draft.parameters()} == {torch.float32}


def test_draft_predicts_the_built_in_models_greedy_tokens(models):
    target, draft = models
    tokenizer = AutoTokenizer.from_pretrained(default_model_path(), local_files_only=True)
    config = GenerationConfig(
        do_sample=False,
        max_new_tokens=NEW_TOKENS,
        eos_token_id=target.generation_config.eos_token_id,
        pad_token_id=target.config.pad_token_id,
    )
    agreed = positions = 0
    for prompt in PROMPTS:
        input_ids = torch.tensor([tokenizer.encode(prompt)])
        with torch.no_grad():
            sequence = target.generate(input_ids, attention_mask=torch.ones_like(input_ids), generation_config=config)
            generated = sequence[0, input_ids.shape[1] :]
            # the draft's greedy next token at each position of the target's greedy generation
            drafted = draft(input_ids=sequence[:, :-1]).logits[0, input_ids.shape[1] - 1 :].argmax(-1)
        agreed += (drafted == generated).sum().item()
        positions += len(generated)
    assert agreed / positions >= AGREEMENT_FLOOR, f"greedy agreement {agreed}/{positions}"
