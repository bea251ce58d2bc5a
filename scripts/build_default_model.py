"""Build the built-in default model that ships in tinyserve/models/default-model/.

    .venv/bin/python scripts/build_default_model.py                 rebuild it in place
    .venv/bin/python scripts/build_default_model.py --out /tmp/m    build it elsewhere
    .venv/bin/python scripts/build_default_model.py --extract-text  rewrite corpus.json first

The recipe of the model that `tinyserve/models/default_model.py` describes: a byte-level
BPE tokenizer and a tiny Llama, trained on the CPU in about a minute from the text in
tinyserve/models/corpus.json, with fixed seeds on one thread. It prints the fingerprint
of what it built: the shipped one means nothing changed. After a deliberate change,
commit the new files and set DEFAULT_MODEL_FINGERPRINT to the new value.

The text is a file of its own because the built-in model used to be trained from the
running interpreter's docstrings, which change between Python releases (3.10's gave a
model that answered "The" with spaces). --extract-text writes it again from the running
Python's standard library: the Zen of Python (this.py, stored ROT13-encoded) and every
docstring of TOKENIZER_MODULES. The shipped text came from Python 3.11.7.

The same text, torch and CPU give the same bytes under every Python. Float rounding in
training can differ on another CPU or torch release, which is why the result ships
instead of being built where it runs.
"""

import argparse
import ast
import codecs
import importlib.util
import json
import math
import platform
import sys
from pathlib import Path

import torch
from tokenizers import Tokenizer
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from a checkout that is not pip-installed
    sys.path.insert(0, str(ROOT))

from tinyserve.models import corpus, default_model  # noqa: E402
from tinyserve.models.tokenizer import (  # noqa: E402
    BOS_TOKEN,
    DEFAULT_CHAT_TEMPLATE,
    EOS_TOKEN,
    IM_END_TOKEN,
    PAD_TOKEN,
    save_tokenizer_files,
    train_bpe_tokenizer,
)

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
PROGRESS_EVERY = 25  # training steps between two progress lines (on stderr)
BATCH_SIZE = 8
SEQUENCE_LENGTH = 64
LEARNING_RATE = 3e-3
WARMUP_STEPS = 20


def build_default_model(folder: Path) -> None:
    """Train the tokenizer and the model and write a Hugging Face checkpoint into `folder`."""
    zen = corpus.zen_of_python()
    tokenizer = train_bpe_tokenizer(zen + corpus.stdlib_docstrings(TOKENIZER_MODULES), VOCAB_SIZE)
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
    # One thread: the order of float additions, and so the weights' last bits, must not
    # depend on how many cores the machine has; matrices this small gain little from more.
    torch.manual_seed(SEED)
    torch.set_num_threads(1)
    model = LlamaForCausalLM(config)
    _train(model, token_ids)

    model.generation_config = GenerationConfig(
        bos_token_id=special_id[BOS_TOKEN],
        eos_token_id=[special_id[EOS_TOKEN], special_id[IM_END_TOKEN]],
        pad_token_id=special_id[PAD_TOKEN],
    )
    model.save_pretrained(folder)
    save_tokenizer_files(tokenizer, folder, DEFAULT_CHAT_TEMPLATE)


def _training_token_ids(tokenizer: Tokenizer, zen: list[str], eos_id: int) -> torch.Tensor:
    """One long stream: each docstring followed by eos, then the Zen as chat turns."""
    documents = corpus.stdlib_docstrings(TRAINING_MODULES)
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
        if (step + 1) % PROGRESS_EVERY == 0 or step == 0:  # it takes about a minute: say how far it is
            print(f"training step {step + 1}/{TRAIN_STEPS}: loss {loss.item():.3f}", file=sys.stderr, flush=True)
    model.eval()


def _learning_rate_factor(step: int) -> float:
    if step < WARMUP_STEPS:
        return (step + 1) / WARMUP_STEPS
    progress = (step - WARMUP_STEPS) / max(1, TRAIN_STEPS - WARMUP_STEPS)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


# ---- the text, from the running Python ----------------------------------------------------------


def extract_text() -> dict:
    """The Zen of Python and the docstrings of TOKENIZER_MODULES, read from this interpreter's own files."""
    return {
        "python": platform.python_version(),
        "zen": _zen_of_python(),
        "docstrings": {name: _docstrings(ast.parse(_module_source(name))) for name in TOKENIZER_MODULES},
    }


def _module_source(module_name: str) -> str:
    # find_spec locates a top-level module's file without executing it (importing `this`
    # would print the Zen to stdout).
    spec = importlib.util.find_spec(module_name)
    if spec is None or spec.origin is None or not spec.origin.endswith(".py"):
        raise ValueError(f"module_name {module_name!r} is not a pure-Python stdlib module")
    return Path(spec.origin).read_text(encoding="utf-8")


def _zen_of_python() -> list[str]:
    """One aphorism per item, title line first, decoded from the ROT13 string `s` in this.py's syntax tree."""
    for node in ast.parse(_module_source("this")).body:
        if isinstance(node, ast.Assign) and [t.id for t in node.targets if isinstance(t, ast.Name)] == ["s"]:
            text = codecs.decode(ast.literal_eval(node.value), "rot13")
            return [line for line in text.splitlines() if line.strip()]
    raise ValueError("this.py has no string `s` holding the Zen of Python")


def _docstrings(tree: ast.Module) -> list[str]:
    """Every docstring of a module (module, classes, functions), in the fixed breadth-first order of `ast.walk`."""
    nodes = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    return [doc for node in ast.walk(tree) if isinstance(node, nodes) and (doc := ast.get_docstring(node))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=default_model.DEFAULT_MODEL_PATH,
                        help="folder to write the checkpoint into (default: the shipped one, replaced)")
    parser.add_argument("--extract-text", action="store_true",
                        help=f"first rewrite {corpus.CORPUS_FILE.name} from this Python's standard library")
    args = parser.parse_args()
    if args.extract_text:
        text = json.dumps(extract_text(), indent=1, ensure_ascii=False)
        corpus.CORPUS_FILE.write_text(text + "\n", encoding="utf-8")
    build_default_model(args.out)  # save_pretrained makes the folder and overwrites the files it writes
    fingerprint = default_model.model_fingerprint(args.out)
    same = "the shipped model" if fingerprint == default_model.DEFAULT_MODEL_FINGERPRINT else "a new model"
    print(f"{args.out}: fingerprint {fingerprint} ({same})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
