"""The built-in default model: a tiny Llama whose files ship inside tinyserve.

`tinyserve serve` and `LLM()` without a model name need a checkpoint, and nothing may be
downloaded. So tinyserve carries one, in `default-model/` beside this file, as a Hugging
Face folder (config.json, generation_config.json, model.safetensors, tokenizer.json,
tokenizer_config.json):

- **Tokenizer**: byte-level BPE with 4096 ids (tokenizer.py), trained on the Zen of
  Python and the docstrings of 23 standard-library modules (corpus.json, copied from
  Python 3.11.7). ChatML special tokens and chat template.
- **Architecture**: `LlamaForCausalLM` with 4 layers, hidden size 256, 8 query heads and 4
  key/value heads (grouped-query attention) of dimension 32, SwiGLU MLP of 768, RoPE
  (theta 10000), RMSNorm, tied input/output embeddings, context 2048 positions:
  about 4.2 million parameters.
- **Weights**: random init (torch seed 0), then 300 AdamW steps on CPU (batches of 8
  sequences of 64 tokens, in a seeded order) over about 6,600 tokens: the docstrings of
  `textwrap`, `queue` and `contextlib`, and the Zen's aphorisms as chat turns (the user
  says one line, the assistant answers the next and ends its turn with <|im_end|>).
  The model knows nothing; it has memorized that little text, so its greedy output is
  varied, vaguely English text about Python rather than one token repeated, and in a
  chat it answers with a Zen-like line and ends its turn.

The weights are stored in float32, as trained (17 MB). bfloat16 would halve the file but
round every weight: the model served would no longer be the one that was trained, and
on a CPU, where tinyserve computes in float32 by default for parity with transformers,
it would be loaded back into float32 with nothing gained. `--dtype bfloat16` still
casts at load time where that pays.

Shipping the files, rather than training them on first use as tinyserve once did, makes
the model the same bytes on every machine and every Python: its fingerprint is a
constant the tests check, and a run recorded with it is replayed, anywhere, on the very
model that served it. `scripts/build_default_model.py` is the recipe that made them.
"""

import hashlib
from pathlib import Path

DEFAULT_MODEL_PATH = Path(__file__).with_name("default-model")
# model_fingerprint(DEFAULT_MODEL_PATH): what scripts/build_default_model.py printed for the shipped files.
DEFAULT_MODEL_FINGERPRINT = "e2d6d956a83cc0fe4063e0435bee0d6c044db9d0e36dc3477f7af9635b5a0c1c"


def default_model_path() -> Path:
    """The folder of the built-in default model."""
    if not (DEFAULT_MODEL_PATH / "model.safetensors").is_file():
        raise FileNotFoundError(
            f"the built-in model's files are missing from {DEFAULT_MODEL_PATH}: reinstall tinyserve from a wheel "
            "or a checkout, or rebuild them with scripts/build_default_model.py"
        )
    return DEFAULT_MODEL_PATH


def model_fingerprint(folder: str | Path) -> str:
    """sha256 over a checkpoint's weights and tokenizer: two folders with one fingerprint generate alike."""
    folder = Path(folder)
    digest = hashlib.sha256()
    for path in sorted(folder.glob("*.safetensors")) + [folder / "tokenizer.json"]:
        digest.update(path.read_bytes())
    return digest.hexdigest()
