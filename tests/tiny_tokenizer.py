"""A small trained tokenizer for tests' random-weight checkpoints.

    tiny_tokenizer_files(checkpoint_folder)            # 512 ids
    tiny_tokenizer_files(checkpoint_folder, vocab_size=1000)

writes tokenizer.json + tokenizer_config.json (with the ChatML chat template) so that
`AutoTokenizer.from_pretrained(checkpoint_folder)` works. The checkpoint's
`vocab_size` must be at least the tokenizer's. The tokenizer is trained on the Zen of
Python and a few stdlib docstrings from the text that ships with tinyserve
(tinyserve/models/corpus.py), so it is the same under every Python; once per process and
vocab size.
"""

import functools
import pathlib

from tokenizers import Tokenizer

from tinyserve.models.corpus import stdlib_docstrings, zen_of_python
from tinyserve.models.tokenizer import DEFAULT_CHAT_TEMPLATE, save_tokenizer_files, train_bpe_tokenizer

TINY_VOCAB_SIZE = 512
TINY_CORPUS_MODULES = ("textwrap", "heapq", "bisect", "difflib")


@functools.cache
def tiny_tokenizer(vocab_size: int = TINY_VOCAB_SIZE) -> Tokenizer:
    texts = zen_of_python() + stdlib_docstrings(TINY_CORPUS_MODULES)
    return train_bpe_tokenizer(texts, vocab_size)


def tiny_tokenizer_files(
    folder: str | pathlib.Path,
    vocab_size: int = TINY_VOCAB_SIZE,
    chat_template: str = DEFAULT_CHAT_TEMPLATE,
) -> pathlib.Path:
    """Add the tiny tokenizer's files to `folder`; returns the folder."""
    folder = pathlib.Path(folder)
    save_tokenizer_files(tiny_tokenizer(vocab_size), folder, chat_template)
    return folder
