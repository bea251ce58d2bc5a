"""What the session's shared server serves, and with which flags (a helper module, not tests).

conftest.py's `server` fixture starts one `tinyserve serve` of the tiny Llama with
these flags, for every test that needs an ordinary server; tests that need other
flags start their own with tinyserve.testing.ServerProcess. The context is long
enough that a request of thousands of tokens is still running when a test acts on
it (drops its stream, say), however fast the machine.
"""

MODEL = "tiny"
MAX_MODEL_LEN = 4096
# The engine's flags, which `tinyserve run-batch` takes as well.
ENGINE_FLAGS = ("--served-model-name", MODEL, "--num-kv-blocks", "512", "--max-model-len", str(MAX_MODEL_LEN))
FLAGS = (*ENGINE_FLAGS, "--log-requests")


def model_folder() -> str:
    """The checkpoint it serves: the tiny Llama with the tiny tokenizer, positions up to MAX_MODEL_LEN."""
    from tests.tiny_checkpoints import tiny_model_with_tokenizer  # torch and transformers: only when needed

    return str(tiny_model_with_tokenizer("llama", max_position_embeddings=MAX_MODEL_LEN))
