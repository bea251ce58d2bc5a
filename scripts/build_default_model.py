"""Build the built-in default model that ships in tinyserve/models/default-model/.

    .venv/bin/python scripts/build_default_model.py                 rebuild it in place
    .venv/bin/python scripts/build_default_model.py --out /tmp/m    build it elsewhere
    .venv/bin/python scripts/build_default_model.py --extract-text  rewrite corpus.json first
    .venv/bin/python scripts/build_default_model.py --draft         rebuild the draft model in place

The recipe of the model that `tinyserve/models/default_model.py` describes: a byte-level
BPE tokenizer and a tiny Llama, trained on the CPU in about a minute from the text in
tinyserve/models/corpus.json, with fixed seeds on one thread. It prints the fingerprint
of what it built: the shipped one means nothing changed. After a deliberate change,
commit the new files and set DEFAULT_MODEL_FINGERPRINT to the new value.

--draft builds the built-in draft model, default-draft/, the speculative-decoding
companion of the built-in model: a one-layer Llama on the built-in model's tokenizer
(its files copied byte for byte), distilled from the shipped built-in model (its
next-token distributions, on the training text and on its own greedy continuations of
prefixes of the corpus and of chat turns). It prints the draft's fingerprint
(DEFAULT_DRAFT_FINGERPRINT) and its greedy agreement with the built-in model.

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
import shutil
import sys
from pathlib import Path

import torch
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, GenerationConfig, LlamaConfig, LlamaForCausalLM

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


def _learning_rate_factor(step: int, train_steps: int = TRAIN_STEPS) -> float:
    if step < WARMUP_STEPS:
        return (step + 1) / WARMUP_STEPS
    progress = (step - WARMUP_STEPS) / max(1, train_steps - WARMUP_STEPS)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


# ---- the draft model (--draft) ------------------------------------------------------------------

# Architecture: the built-in model's head size, RoPE, norm and vocabulary, at half its
# width, a quarter of its depth and half its heads. Most of its parameters are the
# (tied) embeddings, which every draft of this vocabulary needs.
DRAFT_HIDDEN_SIZE = 128
DRAFT_NUM_HIDDEN_LAYERS = 1
DRAFT_NUM_ATTENTION_HEADS = 4
DRAFT_NUM_KEY_VALUE_HEADS = 2
DRAFT_INTERMEDIATE_SIZE = 384

# Distillation text: windows of the built-in model's training stream, and the built-in
# model's own greedy continuations (up to DRAFT_SEQUENCE_LENGTH tokens in all, without
# stopping at an end token) of prompts: prefixes of the training stream and of the other
# modules' docstrings at seeded offsets, and every Zen aphorism said by the user in a chat.
DRAFT_SEQUENCE_LENGTH = 128
DRAFT_PROMPT_LENGTH = 16
DRAFT_STREAM_PROMPTS = 384
DRAFT_OTHER_PROMPTS = 128
DRAFT_GENERATION_BATCH = 64
CHAT_PROMPT = "<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"

# Training: the draft learns the built-in model's next-token distribution (KL divergence
# to its softmax) at every position of every window, the built-in model's recipe otherwise.
DRAFT_SEED = 1
DRAFT_TRAIN_STEPS = 600


def build_default_draft(folder: Path, target_folder: Path) -> None:
    """Distil the built-in model in `target_folder` into a draft written into `folder`, which shares its tokenizer files."""
    torch.manual_seed(DRAFT_SEED)
    torch.set_num_threads(1)  # as the built-in model's training: the same bits on every machine
    target = AutoModelForCausalLM.from_pretrained(target_folder, local_files_only=True, dtype=torch.float32).eval()
    tokenizer = Tokenizer.from_file(str(target_folder / "tokenizer.json"))
    zen = corpus.zen_of_python()
    eos_id = tokenizer.token_to_id(EOS_TOKEN)

    config = LlamaConfig(
        vocab_size=target.config.vocab_size,
        hidden_size=DRAFT_HIDDEN_SIZE,
        intermediate_size=DRAFT_INTERMEDIATE_SIZE,
        num_hidden_layers=DRAFT_NUM_HIDDEN_LAYERS,
        num_attention_heads=DRAFT_NUM_ATTENTION_HEADS,
        num_key_value_heads=DRAFT_NUM_KEY_VALUE_HEADS,
        head_dim=HEAD_DIM,
        max_position_embeddings=MAX_POSITION_EMBEDDINGS,
        rope_theta=ROPE_THETA,
        rms_norm_eps=RMS_NORM_EPS,
        tie_word_embeddings=True,
        bos_token_id=target.config.bos_token_id,
        eos_token_id=target.config.eos_token_id,
        pad_token_id=target.config.pad_token_id,
    )
    windows = _distillation_windows(target, tokenizer, zen, eos_id)
    draft = LlamaForCausalLM(config)
    _distil(draft, target, windows)

    draft.save_pretrained(folder)
    # The very bytes: a drafted id means the same token to the model that verifies it, with the same end tokens.
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copyfile(target_folder / name, folder / name)


def _distillation_windows(target, tokenizer: Tokenizer, zen: list[str], eos_id: int) -> torch.Tensor:
    """(windows, DRAFT_SEQUENCE_LENGTH) token ids: the training stream's, then the built-in model's greedy continuations."""
    generator = torch.Generator().manual_seed(DRAFT_SEED)
    stream = _training_token_ids(tokenizer, zen, eos_id)
    num_windows = len(stream) // DRAFT_SEQUENCE_LENGTH
    windows = [stream[: num_windows * DRAFT_SEQUENCE_LENGTH].view(num_windows, DRAFT_SEQUENCE_LENGTH)]

    other_modules = [name for name in TOKENIZER_MODULES if name not in TRAINING_MODULES]
    other = torch.tensor([i for text in corpus.stdlib_docstrings(other_modules) for i in tokenizer.encode(text).ids + [eos_id]])
    prompts = [
        _prefixes(stream, DRAFT_STREAM_PROMPTS, generator),
        _prefixes(other, DRAFT_OTHER_PROMPTS, generator),
    ]
    for batch in torch.cat(prompts).split(DRAFT_GENERATION_BATCH):
        windows.append(_greedy(target, batch, DRAFT_SEQUENCE_LENGTH - DRAFT_PROMPT_LENGTH))
    for question in zen:
        prompt = torch.tensor([tokenizer.encode(CHAT_PROMPT.format(question=question)).ids])
        windows.append(_greedy(target, prompt, DRAFT_SEQUENCE_LENGTH - prompt.shape[1]))
    print(f"distillation text: {sum(len(w) for w in windows)} windows of {DRAFT_SEQUENCE_LENGTH} tokens",
          file=sys.stderr, flush=True)
    return torch.cat(windows)


def _prefixes(ids: torch.Tensor, count: int, generator: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, len(ids) - DRAFT_PROMPT_LENGTH, (count,), generator=generator)
    return torch.stack([ids[start : start + DRAFT_PROMPT_LENGTH] for start in starts.tolist()])


def _greedy(model, input_ids: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """The model's greedy continuation of `new_tokens` tokens, end tokens included, prompts of one length."""
    eos_token_id, model.generation_config.eos_token_id = model.generation_config.eos_token_id, None  # no stop
    config = GenerationConfig(do_sample=False, max_new_tokens=new_tokens, pad_token_id=model.config.pad_token_id)
    try:
        with torch.no_grad():
            return model.generate(input_ids, attention_mask=torch.ones_like(input_ids), generation_config=config)
    finally:
        model.generation_config.eos_token_id = eos_token_id


def _distil(draft: LlamaForCausalLM, target, windows: torch.Tensor) -> None:
    """AdamW on the KL divergence from the target's next-token distribution to the draft's, batches in a seeded order."""
    num_windows = len(windows)
    num_epochs = math.ceil(DRAFT_TRAIN_STEPS * BATCH_SIZE / num_windows)
    generator = torch.Generator().manual_seed(DRAFT_SEED)
    order = torch.cat([torch.randperm(num_windows, generator=generator) for _ in range(num_epochs)])

    optimizer = torch.optim.AdamW(draft.parameters(), lr=LEARNING_RATE, betas=(0.9, 0.95), weight_decay=0.1)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: _learning_rate_factor(step, DRAFT_TRAIN_STEPS))
    draft.train()
    for step in range(DRAFT_TRAIN_STEPS):
        batch = windows[order[step * BATCH_SIZE : (step + 1) * BATCH_SIZE]]
        with torch.no_grad():
            target_logprobs = torch.log_softmax(target(input_ids=batch).logits, dim=-1).flatten(0, 1)
        draft_logprobs = torch.log_softmax(draft(input_ids=batch).logits, dim=-1).flatten(0, 1)
        loss = torch.nn.functional.kl_div(draft_logprobs, target_logprobs, log_target=True, reduction="batchmean")
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        if (step + 1) % PROGRESS_EVERY == 0 or step == 0:
            agree = (draft_logprobs.argmax(-1) == target_logprobs.argmax(-1)).float().mean().item()
            print(f"training step {step + 1}/{DRAFT_TRAIN_STEPS}: KL {loss.item():.3f}, argmax agreement {agree:.3f}",
                  file=sys.stderr, flush=True)
    draft.eval()


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
    parser.add_argument("--out", type=Path, default=None,
                        help="folder to write the checkpoint into (default: the shipped one, replaced)")
    parser.add_argument("--draft", action="store_true",
                        help="build the draft model instead, distilled from the shipped built-in model")
    parser.add_argument("--extract-text", action="store_true",
                        help=f"first rewrite {corpus.CORPUS_FILE.name} from this Python's standard library")
    args = parser.parse_args()
    if args.draft and args.extract_text:
        parser.error("--draft distils the shipped built-in model: rebuild that first, then the draft")
    if args.draft:
        out = args.out or default_model.DEFAULT_DRAFT_PATH
        build_default_draft(out, default_model.default_model_path())
        fingerprint = default_model.model_fingerprint(out)
        same = "the shipped draft" if fingerprint == default_model.DEFAULT_DRAFT_FINGERPRINT else "a new draft"
        print(f"{out}: fingerprint {fingerprint} ({same})")
        return 0
    args.out = args.out or default_model.DEFAULT_MODEL_PATH
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
