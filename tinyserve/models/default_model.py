"""The built-in default model: a tiny Llama trained on this machine, on first use.

`tinyserve serve` and `LLM()` without a model name need a checkpoint, and nothing may be
downloaded. So tinyserve builds one, deterministically, the first time it is asked for:

- **Tokenizer**: byte-level BPE with 4096 ids (tokenizer.py), trained on the docstrings
  of a fixed list of standard-library modules and the Zen of Python, read from the
  running Python's own files. ChatML special tokens and chat template.
- **Architecture**: `LlamaForCausalLM` with 4 layers, hidden size 256, 8 query heads and 4
  key/value heads (grouped-query attention) of dimension 32, SwiGLU MLP of 768, RoPE
  (theta 10000), RMSNorm, tied input/output embeddings, context 2048 positions:
  about 4.2 million parameters, stored in float32 (17 MB).
- **Weights**: random init (torch seed 0), then 300 AdamW steps on CPU (batches of 8
  sequences of 64 tokens, in a seeded order) over about 6,600 tokens: the docstrings of
  `textwrap`, `queue` and `contextlib`, and the Zen's aphorisms as chat turns (the user
  says one line, the assistant answers the next and ends its turn with <|im_end|>).
  The model knows nothing; it has memorized that little text, so its greedy output is
  varied, vaguely English text about Python rather than one token repeated, and in a
  chat it answers with a Zen-like line and ends its turn.

The build takes about 50 seconds on one CPU thread. The result is cached under
`$TINYSERVE_CACHE_DIR`, else `$XDG_CACHE_HOME/tinyserve`, else `~/.cache/tinyserve`, in
`default-model-v{DEFAULT_MODEL_VERSION}`; change the version when anything below changes.
It is built into a temporary folder and renamed into place, under a file lock, so a
process never sees a half-written model and two processes never build it twice.

Weights are reproducible for a given Python, torch and CPU; another Python version has
other docstrings, and float rounding differs across CPUs, so caches are not meant to be
shared between machines.
"""

import fcntl
import math
import os
import pathlib
import shutil
import tempfile

import torch
from tokenizers import Tokenizer
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

from tinyserve.models.corpus import stdlib_docstrings, zen_of_python
from tinyserve.models.tokenizer import (
    BOS_TOKEN,
    DEFAULT_CHAT_TEMPLATE,
    EOS_TOKEN,
    IM_END_TOKEN,
    PAD_TOKEN,
    save_tokenizer_files,
    train_bpe_tokenizer,
)

DEFAULT_MODEL_VERSION = 1

# Architecture.
VOCAB_SIZE = 4096
HIDDEN_SIZE = 256
NUM_HIDDEN_LAYERS = 4
NUM_ATTENTION_HEADS = 8
NUM_KEY_VALUE_HEADS = 4
HEAD_DIM = 32
INTERMEDIATE_SIZE = 768
MAX_POSITION_EMBEDDINGS = 2048
ROPE_THETA = 10000.0
RMS_NORM_EPS = 1e-5

# Text. The tokenizer sees more modules than the model trains on: a 4096-id vocabulary
# needs the variety, while a model this small only learns a small text well.
TOKENIZER_MODULES = (
    "argparse", "bisect", "calendar", "collections", "contextlib", "csv", "dataclasses",
    "difflib", "enum", "fractions", "functools", "heapq", "json", "logging", "pathlib",
    "queue", "random", "shutil", "statistics", "string", "tempfile", "textwrap", "threading",
)  # fmt: skip
TRAINING_MODULES = ("textwrap", "queue", "contextlib")
# The Zen's aphorisms as chat turns: a user says one line, the assistant answers the next.
CHAT_TURNS = "<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n{answer}<|im_end|>\n"
CHAT_REPEATS = 4

# Training.
SEED = 0
TRAIN_STEPS = 300
BATCH_SIZE = 8
SEQUENCE_LENGTH = 64
LEARNING_RATE = 3e-3
WARMUP_STEPS = 20


def default_cache_dir() -> pathlib.Path:
    """Where tinyserve keeps what it builds: $TINYSERVE_CACHE_DIR, else the XDG cache."""
    if cache_dir := os.environ.get("TINYSERVE_CACHE_DIR"):
        return pathlib.Path(cache_dir).expanduser()
    if xdg_cache_home := os.environ.get("XDG_CACHE_HOME"):
        return pathlib.Path(xdg_cache_home).expanduser() / "tinyserve"
    return pathlib.Path.home() / ".cache" / "tinyserve"


def default_model_path() -> pathlib.Path:
    """The folder of the built-in default model, building it first if it is not cached."""
    cache_dir = default_cache_dir()
    name = f"default-model-v{DEFAULT_MODEL_VERSION}"
    final_path = cache_dir / name
    if final_path.is_dir():
        return final_path
    cache_dir.mkdir(parents=True, exist_ok=True)
    with open(cache_dir / f"{name}.lock", "w") as lock_file:
        # Whoever gets the lock first builds; the others wait here and then find it built.
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        if final_path.is_dir():
            return final_path
        # Temporary folders left by a builder that died: nobody else holds the lock.
        for stale in cache_dir.glob(f".{name}.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        build_path = pathlib.Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=cache_dir))
        try:
            build_default_model(build_path)
            os.rename(build_path, final_path)
        except BaseException:
            shutil.rmtree(build_path, ignore_errors=True)
            raise
    return final_path


def build_default_model(folder: str | pathlib.Path) -> None:
    """Train the tokenizer and the model and write a Hugging Face checkpoint into `folder`."""
    folder = pathlib.Path(folder)
    zen = zen_of_python()
    tokenizer = train_bpe_tokenizer(zen + stdlib_docstrings(TOKENIZER_MODULES), VOCAB_SIZE)
    special_id = {token: tokenizer.token_to_id(token) for token in (BOS_TOKEN, EOS_TOKEN, IM_END_TOKEN, PAD_TOKEN)}

    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=HIDDEN_SIZE,
        intermediate_size=INTERMEDIATE_SIZE,
        num_hidden_layers=NUM_HIDDEN_LAYERS,
        num_attention_heads=NUM_ATTENTION_HEADS,
        num_key_value_heads=NUM_KEY_VALUE_HEADS,
        head_dim=HEAD_DIM,
        max_position_embeddings=MAX_POSITION_EMBEDDINGS,
        rope_theta=ROPE_THETA,
        rms_norm_eps=RMS_NORM_EPS,
        tie_word_embeddings=True,
        bos_token_id=special_id[BOS_TOKEN],
        eos_token_id=special_id[EOS_TOKEN],
        pad_token_id=special_id[PAD_TOKEN],
    )
    token_ids = _training_token_ids(tokenizer, zen, special_id[EOS_TOKEN])
    # fork_rng: seeding must not change the caller's random state. One thread: matrices
    # this small gain little from a second one, and on a busy machine two OpenMP threads
    # waiting on each other made training four times slower than one.
    num_threads = torch.get_num_threads()
    with torch.random.fork_rng():
        torch.manual_seed(SEED)
        torch.set_num_threads(1)
        try:
            model = LlamaForCausalLM(config)
            _train(model, token_ids)
        finally:
            torch.set_num_threads(num_threads)

    model.generation_config = GenerationConfig(
        bos_token_id=special_id[BOS_TOKEN],
        eos_token_id=[special_id[EOS_TOKEN], special_id[IM_END_TOKEN]],
        pad_token_id=special_id[PAD_TOKEN],
    )
    model.save_pretrained(folder)
    save_tokenizer_files(tokenizer, folder, DEFAULT_CHAT_TEMPLATE)


def _training_token_ids(tokenizer: Tokenizer, zen: list[str], eos_id: int) -> torch.Tensor:
    """One long stream: each docstring followed by eos, then the Zen as chat turns."""
    documents = stdlib_docstrings(TRAINING_MODULES)
    chats = [CHAT_TURNS.format(question=question, answer=answer) for question, answer in zip(zen, zen[1:])]
    ids: list[int] = []
    for text in documents:
        ids.extend(tokenizer.encode(text).ids)
        ids.append(eos_id)
    for text in chats * CHAT_REPEATS:
        ids.extend(tokenizer.encode(text).ids)
    return torch.tensor(ids, dtype=torch.long)


def _train(model: LlamaForCausalLM, token_ids: torch.Tensor) -> None:
    """Next-token prediction with AdamW over fixed-length windows of the stream, in a
    seeded order; the learning rate warms up linearly, then decays along a cosine."""
    num_windows = len(token_ids) // SEQUENCE_LENGTH
    windows = token_ids[: num_windows * SEQUENCE_LENGTH].view(num_windows, SEQUENCE_LENGTH)
    # Enough shuffled passes over the windows to fill every step's batch.
    num_epochs = math.ceil(TRAIN_STEPS * BATCH_SIZE / num_windows)
    generator = torch.Generator().manual_seed(SEED)
    order = torch.cat([torch.randperm(num_windows, generator=generator) for _ in range(num_epochs)])

    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, betas=(0.9, 0.95), weight_decay=0.1)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, _learning_rate_factor)
    model.train()
    for step in range(TRAIN_STEPS):
        batch = windows[order[step * BATCH_SIZE : (step + 1) * BATCH_SIZE]]
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
    model.eval()


def _learning_rate_factor(step: int) -> float:
    if step < WARMUP_STEPS:
        return (step + 1) / WARMUP_STEPS
    progress = (step - WARMUP_STEPS) / max(1, TRAIN_STEPS - WARMUP_STEPS)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))
