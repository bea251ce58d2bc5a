"""The router's defaults that its command line shows: plain values, in a module that imports nothing.

`tinyserve router --help` prints them without importing the router's app (FastAPI, httpx, uvicorn).
The limits on what a client may send are the server's own (entrypoints/api/defaults.py).
"""

DEFAULT_HEALTH_CHECK_INTERVAL_S = 10.0  # vLLM's router checks every 60 s; a dead backend costs requests meanwhile
DEFAULT_HEALTH_CHECK_TIMEOUT_S = 5.0  # vLLM's router's
DEFAULT_HEALTH_FAILURE_THRESHOLD = 3  # vLLM's router's
# A whole (not streamed) answer's headers come once its generation is done: long enough for a long one.
DEFAULT_BACKEND_HEADER_TIMEOUT_S = 600.0
DEFAULT_KV_INDEX_MAX_BLOCKS = 1 << 20  # per backend, about 100 MB of hashes; far more than a GPU's KV pool
MAX_BACKEND_ANSWER_BYTES = 8 << 20  # an answer the router reads whole: /v1/models, a prefill's, /metrics
