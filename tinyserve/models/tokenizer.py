"""Tokenizers: train a small byte-level BPE offline, save it as a Hugging Face
checkpoint's tokenizer files, and load any checkpoint's tokenizer.

The render stage (chat template + tokenize) and the detokenize stage both use the
tokenizer that `load_tokenizer` returns: a `transformers` tokenizer, exactly what
`AutoTokenizer` gives for the same folder, so tinyserve and Hugging Face agree on ids.

The trained tokenizer is byte-level BPE (GPT-2 style: every byte has a token, so any text
encodes without an unknown token). Its pre-tokenization is the one Qwen2 uses (a regex
split, then bytes mapped to printable characters) and it NFC-normalizes its input. That
choice is deliberate: for `model_type` "qwen2" transformers 5 ignores the pipeline stored
in tokenizer.json and rebuilds Qwen2's own; a tokenizer that already *is* that pipeline
encodes identically whether a checkpoint says llama, qwen2, qwen3 or mistral.

Special tokens (ChatML, as Qwen and many small chat models use):

    <|begin_of_text|>   bos (not added when encoding; prompts start with text)
    <|end_of_text|>     eos: end of a document
    <|im_start|>        start of a chat turn: "<|im_start|>user\\n"
    <|im_end|>          end of a chat turn; generation stops on it too
    <|pad|>             padding
"""

import json
import pathlib
from collections.abc import Iterable

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerBase

BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
IM_START_TOKEN = "<|im_start|>"
IM_END_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|pad|>"
# Trained first, so they get ids 0..4 in this order.
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, IM_START_TOKEN, IM_END_TOKEN, PAD_TOKEN)

# Qwen2's split: contractions, letter runs (with one leading non-letter such as a space),
# single digits, punctuation runs, newlines, other whitespace.
PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"""
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# ChatML. Each message becomes "<|im_start|>{role}\n{content}<|im_end|>\n"; with
# add_generation_prompt the prompt ends with an open assistant turn for the model to fill.
# With tools (Qwen2.5's way, which the hermes tool-call parser reads back): a system turn
# lists them as JSON in <tools>, an assistant's calls are <tool_call>{"name", "arguments"}
# </tool_call> blocks, and a tool's answer is a user turn in <tool_response>.
DEFAULT_CHAT_TEMPLATE = (
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\n' -}}"
    "{%- if messages[0]['role'] == 'system' -%}{{- messages[0]['content'] + '\\n\\n' -}}{%- endif -%}"
    "{{- '# Tools\\n\\nYou may call one or more functions. Their signatures are in <tools></tools>:\\n<tools>' -}}"
    "{%- for tool in tools -%}{{- '\\n' + (tool | tojson) -}}{%- endfor -%}"
    "{{- '\\n</tools>\\n\\nFor each call, return a JSON object with the function name and arguments in "
    "<tool_call></tool_call>:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": <args-json-object>}"
    "\\n</tool_call><|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if tools and loop.first and message['role'] == 'system' -%}"
    "{%- elif message['role'] == 'tool' -%}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message['content'] + '\\n</tool_response><|im_end|>\\n' -}}"
    "{%- elif message['role'] == 'assistant' and message['tool_calls'] is defined and message['tool_calls'] -%}"
    "{{- '<|im_start|>assistant\\n' + message['content'] -}}"
    "{%- for call in message['tool_calls'] -%}"
    "{{- '\\n<tool_call>\\n' + ({'name': call['function']['name'], 'arguments': call['function']['arguments']}"
    " | tojson) + '\\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- endif -%}"
)

# Files whose presence means a folder carries a tokenizer transformers can load.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """Train a byte-level BPE tokenizer of `vocab_size` ids (special tokens included).

    Deterministic: the same texts in the same order give the same vocabulary and merges.
    """
    min_vocab_size = len(SPECIAL_TOKENS) + len(pre_tokenizers.ByteLevel.alphabet())
    if vocab_size < min_vocab_size:
        raise ValueError(f"vocab_size must be at least {min_vocab_size} (special tokens + 256 bytes), got {vocab_size}")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def save_tokenizer_files(tokenizer: Tokenizer, folder: str | pathlib.Path, chat_template: str) -> None:
    """Write tokenizer.json and tokenizer_config.json into a checkpoint folder.

    `tokenizer_class` is pinned to PreTrainedTokenizerFast (transformers 5 reads it as its
    generic TokenizersBackend) so that AutoTokenizer loads tokenizer.json as it is instead
    of a model type's own tokenizer class.
    """
    folder = pathlib.Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        # Byte-level BPE has no unknown token; None keeps a model type's default
        # (Qwen2's is "<|endoftext|>") from being added as a new token.
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        # Decoding must give back exactly the bytes that were generated; "clean up"
        # would delete the space in " ." and break incremental detokenization.
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1_000_000,
        "chat_template": chat_template,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")


def load_tokenizer(path: str | pathlib.Path) -> PreTrainedTokenizerBase:
    """The checkpoint's tokenizer, as `transformers.AutoTokenizer` loads it from local files."""
    folder = pathlib.Path(path)
    if not folder.is_dir():
        raise ValueError(f"tokenizer path {str(folder)!r} is not a folder")
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise ValueError(
            f"tokenizer path {str(folder)!r} has no tokenizer files (expected one of {', '.join(TOKENIZER_FILES)})"
        )
    return AutoTokenizer.from_pretrained(folder, local_files_only=True)
