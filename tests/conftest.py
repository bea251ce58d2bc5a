"""Shared test set-up.

TRITON_INTERPRET must be set before any @triton.jit function is created, so it is
set here, before tinyserve's kernels can be imported. HF_HUB_OFFLINE keeps
transformers from trying the network for a name it does not find locally.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
