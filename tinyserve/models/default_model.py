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

**The built-in draft model**, in `default-draft/`, is the built-in model's companion for
speculative decoding (`speculative_config={"method": "draft_model", ...}` without a
`"model"`): a small model proposes the next few tokens, the built-in model verifies them
in one forward pass, and every drafted token it agrees with is a decode step saved.

- **Tokenizer**: the built-in model's own: tokenizer.json, tokenizer_config.json and
  generation_config.json are copies of its files, byte for byte, so a drafted id is the
  same token to the model that verifies it (same 4096 ids, special tokens, chat template
  and end tokens).
- **Architecture**: `LlamaForCausalLM` with 1 layer, hidden size 128, 4 query heads and 2
  key/value heads of dimension 32, SwiGLU MLP of 384, and otherwise the built-in model's
  settings (RoPE theta 10000, RMSNorm, tied embeddings, 2048 positions): about 0.72 million
  parameters, 0.52 million (73 %) of them the embeddings. On a CPU a decode step costs about
  4 to 6 times less than the built-in model's.
- **Weights**: distilled from the shipped built-in model, since a draft is worth what it
  agrees with its target, not what it knows of the text: random init (torch seed 1),
  then 600 AdamW steps on one thread, each on 8 windows of 128 tokens, minimizing the
  KL divergence from the built-in model's next-token distribution to the draft's at
  every position. The windows are the built-in model's training text and its own greedy
  continuations (through end tokens) of 512 seeded 16-token prefixes of the corpus
  (its training text and the other docstrings) and of each Zen aphorism said in a chat.
- **Agreement**: along the built-in model's greedy generations of 32 prompts of other
  seeds, the draft's greedy next token is the built-in model's at 49 % of the positions;
  with 3 drafted tokens a verification step yields 1.9 tokens on average
  (`scripts/measure_default_draft.py`).

`default_draft_path()` finds its files; DEFAULT_DRAFT_FINGERPRINT is what
`scripts/build_default_model.py --draft` printed for them.

**The built-in vision model**, in `default-vision/`, named `tinyserve-vision`
(`LLM("tinyserve-vision")`, `tinyserve serve tinyserve-vision`): the built-in model with
an image encoder, so that images can be served with nothing downloaded (tinyserve/multimodal/).

- **Architecture**: LLaVA (`LlavaForConditionalGeneration`). The language model is the
  built-in model, weight for weight, with one more vocabulary row, all zeros, for the image
  placeholder "<image>" (id 4096). The vision tower is CLIP's: 224x224 pixels in 14x14
  patches, so 256 placeholder rows an image, 3 layers of width 128 (the features of the last
  but one are used, LLaVA's `vision_feature_layer` -2); LLaVA's two-layer projector maps a
  row to the language model's width. About 0.7 million parameters besides the language model.
- **Weights**: the tower and projector are random (torch seed 2), the projector's output
  scaled so that an image row is as large as a token embedding row. It knows nothing of
  images: what it shows is the mechanics (placeholders, the encoder before the prefill, its
  cache and budget), and that two images give two answers.
- **Processor**: transformers' LlavaProcessor (CLIP's resize, centre crop and normalisation)
  and a ChatML template that writes an image part as "<image>" and a newline.

`default_vision_path()` finds its files; DEFAULT_VISION_FINGERPRINT is what
`scripts/build_default_vision.py` printed for them.
"""

import hashlib
from pathlib import Path

DEFAULT_MODEL_PATH = Path(__file__).with_name("default-model")
# model_fingerprint(DEFAULT_MODEL_PATH): what scripts/build_default_model.py printed for the shipped files.
DEFAULT_MODEL_FINGERPRINT = "e2d6d956a83cc0fe4063e0435bee0d6c044db9d0e36dc3477f7af9635b5a0c1c"

DEFAULT_DRAFT_PATH = Path(__file__).with_name("default-draft")
# model_fingerprint(DEFAULT_DRAFT_PATH): what scripts/build_default_model.py --draft printed for the shipped files.
DEFAULT_DRAFT_FINGERPRINT = "260caa5653da19b1d52e850ca9d3d01d10c9be69e282e2ee806955e525a78863"

DEFAULT_VISION_PATH = Path(__file__).with_name("default-vision")
# model_fingerprint(DEFAULT_VISION_PATH): what scripts/build_default_vision.py printed for the shipped files.
DEFAULT_VISION_FINGERPRINT = "7a7da850deae729291586b1f8a54aaf49f70516b7361b01b7f76e750f7e42654"


def _shipped(folder: Path, name: str, recipe: str) -> Path:
    """A shipped model's folder, or a FileNotFoundError that says how to get its files back."""
    if not (folder / "model.safetensors").is_file():
        raise FileNotFoundError(f"the built-in {name}'s files are missing from {folder}: reinstall tinyserve from a "
                                f"wheel or a checkout, or rebuild them with {recipe}")
    return folder


def default_model_path() -> Path:
    """The folder of the built-in default model."""
    return _shipped(DEFAULT_MODEL_PATH, "model", "scripts/build_default_model.py")


def default_draft_path() -> Path:
    """The folder of the built-in draft model, the built-in model's companion for speculative decoding."""
    return _shipped(DEFAULT_DRAFT_PATH, "draft model", "scripts/build_default_model.py --draft")


def default_vision_path() -> Path:
    """The folder of the built-in vision model, the built-in model with an image encoder (LLaVA)."""
    return _shipped(DEFAULT_VISION_PATH, "vision model", "scripts/build_default_vision.py")


def model_fingerprint(folder: str | Path) -> str:
    """sha256 over a checkpoint's weights and tokenizer: two folders with one fingerprint generate alike."""
    folder = Path(folder)
    digest = hashlib.sha256()
    for path in sorted(folder.glob("*.safetensors")) + [folder / "tokenizer.json"]:
        digest.update(path.read_bytes())
    return digest.hexdigest()
