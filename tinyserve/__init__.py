"""tinyserve: an LLM serving stack to read and watch.

    from tinyserve import LLM, SamplingParams
    llm = LLM()                      # the built-in model, built on first use
    outputs = llm.generate("Hello", SamplingParams(max_tokens=32))

The names below are imported on first use, so `import tinyserve.engine.core...`
(the scheduler, say) stays free of torch and transformers.
"""

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "LLM": "tinyserve.entrypoints.llm",
    "AsyncLLM": "tinyserve.frontend.async_llm",
    "EngineArgs": "tinyserve.config",
    "SamplingParams": "tinyserve.sampling_params",
    "RequestOutput": "tinyserve.outputs",
    "CompletionOutput": "tinyserve.outputs",
    "PoolingParams": "tinyserve.pooling_params",  # a pooling engine's: LLM(model, runner="pooling").embed(...)
    "PoolingRequestOutput": "tinyserve.outputs",
    "EmbeddingRequestOutput": "tinyserve.outputs",
}
__all__ = [*_EXPORTS, "__version__"]


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'tinyserve' has no attribute {name!r}")
