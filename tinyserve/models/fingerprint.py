"""A checkpoint's fingerprint, as a traced run's manifest records it, so replay can tell another model.

Replaying a trace on other weights gives other tokens, and a token-by-token mismatch
would not say why. So the run's manifest holds a sha256 over the model's weights and
tokenizer (default_model.model_fingerprint), and replay compares it first. Hashing reads
every byte of the weights: it is done for checkpoints up to FINGERPRINT_MAX_BYTES (the
built-in model's 17 MB take ~20 ms); a larger one's manifest says None, and replay then
cannot vouch for the model.
"""

from pathlib import Path

from tinyserve.models.default_model import model_fingerprint

FINGERPRINT_MAX_BYTES = 1 << 30


def manifest_fingerprint(folder: str | Path) -> str | None:
    """The model folder's fingerprint, or None when its weights are too large to hash at start-up."""
    folder = Path(folder)
    weights = sum(path.stat().st_size for path in folder.glob("*.safetensors"))
    if weights > FINGERPRINT_MAX_BYTES or not (folder / "tokenizer.json").is_file():
        return None
    return model_fingerprint(folder)
