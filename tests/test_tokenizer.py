"""The trained byte-level BPE tokenizer, its saved files, and loading them back."""

import json

import pytest
from transformers import AutoTokenizer

from tests.tiny_tokenizer import TINY_VOCAB_SIZE, tiny_tokenizer, tiny_tokenizer_files
from tinyserve.models.corpus import stdlib_docstrings, zen_of_python
from tinyserve.models.tokenizer import (
    DEFAULT_CHAT_TEMPLATE,
    EOS_TOKEN,
    IM_END_TOKEN,
    IM_START_TOKEN,
    SPECIAL_TOKENS,
    load_tokenizer,
    train_bpe_tokenizer,
)

TEXTS = [
    "Beautiful is better than ugly.",
    "  two leading spaces, tabs\tand\n\nblank lines  ",
    "digits 1234567890 and don't we'll",
    "naïve café, 日本語のテキスト, emoji 🤖🎉 and e\u0301 (combining accent)",
    "<|im_start|>user\nhello<|im_end|>\n",
]


def test_every_text_decodes_back_to_itself():
    tokenizer = tiny_tokenizer()
    for text in TEXTS[:3]:
        assert tokenizer.decode(tokenizer.encode(text).ids) == text
    # NFC normalization composes "e" + U+0301 into "é" before encoding.
    unicode_text = TEXTS[3]
    assert tokenizer.decode(tokenizer.encode(unicode_text).ids) == unicode_text.replace("e\u0301", "\u00e9")


def test_vocabulary_has_the_requested_size_and_special_tokens_first():
    tokenizer = tiny_tokenizer()
    assert tokenizer.get_vocab_size() == TINY_VOCAB_SIZE
    assert [tokenizer.token_to_id(token) for token in SPECIAL_TOKENS] == list(range(len(SPECIAL_TOKENS)))


def test_special_tokens_encode_as_single_ids():
    tokenizer = tiny_tokenizer()
    ids = tokenizer.encode(f"{IM_START_TOKEN}user\nhi{IM_END_TOKEN}{EOS_TOKEN}").ids
    assert ids[0] == tokenizer.token_to_id(IM_START_TOKEN)
    assert ids[-2:] == [tokenizer.token_to_id(IM_END_TOKEN), tokenizer.token_to_id(EOS_TOKEN)]


def test_training_is_deterministic():
    texts = zen_of_python() + stdlib_docstrings(["textwrap"])
    assert train_bpe_tokenizer(texts, 400).to_str() == train_bpe_tokenizer(texts, 400).to_str()


def test_vocab_size_smaller_than_the_byte_alphabet_is_rejected():
    with pytest.raises(ValueError, match="vocab_size"):
        train_bpe_tokenizer(["some text"], 100)


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3", "mistral"])
def test_autotokenizer_gives_the_trained_tokenizers_ids(tmp_path, model_type):
    # transformers picks a tokenizer class by model_type; for qwen2 it rebuilds Qwen2's
    # own pre-tokenizer, which must then be the one the tokenizer was trained with.
    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type}))
    tiny_tokenizer_files(tmp_path)
    trained = tiny_tokenizer()
    loaded = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    for text in TEXTS:
        ids = trained.encode(text).ids
        assert loaded.encode(text) == ids
        assert loaded.decode(ids) == trained.decode(ids, skip_special_tokens=False)
    assert len(loaded) == trained.get_vocab_size()
    assert loaded.eos_token == EOS_TOKEN


def test_load_tokenizer_reads_the_saved_files(tmp_path):
    tiny_tokenizer_files(tmp_path)
    loaded = load_tokenizer(tmp_path)
    assert loaded.encode(TEXTS[0]) == tiny_tokenizer().encode(TEXTS[0]).ids


def test_load_tokenizer_rejects_a_folder_without_tokenizer_files(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match="no tokenizer files"):
        load_tokenizer(tmp_path)


def test_load_tokenizer_rejects_a_missing_folder(tmp_path):
    with pytest.raises(ValueError, match="not a folder"):
        load_tokenizer(tmp_path / "missing")


def test_chat_turn_markers_are_skipped_when_decoding_without_special_tokens(tmp_path):
    loaded = load_tokenizer(tiny_tokenizer_files(tmp_path))
    ids = loaded.encode(f"{IM_START_TOKEN}assistant\nSimple.{IM_END_TOKEN}")
    assert loaded.decode(ids, skip_special_tokens=True) == "assistant\nSimple."


def test_chat_template_renders_system_user_and_assistant_turns(tmp_path):
    loaded = load_tokenizer(tiny_tokenizer_files(tmp_path))
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Why?"},
        {"role": "assistant", "content": "Because."},
    ]
    rendered = loaded.apply_chat_template(messages, tokenize=False)
    assert rendered == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nWhy?<|im_end|>\n"
        "<|im_start|>assistant\nBecause.<|im_end|>\n"
    )


def test_generation_prompt_opens_an_assistant_turn(tmp_path):
    loaded = load_tokenizer(tiny_tokenizer_files(tmp_path, chat_template=DEFAULT_CHAT_TEMPLATE))
    messages = [{"role": "user", "content": "Hi"}]
    rendered = loaded.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
