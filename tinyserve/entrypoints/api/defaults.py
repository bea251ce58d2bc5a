"""The server's defaults that its command line shows: plain values, in a module that imports nothing.

`tinyserve serve --help` prints them without importing the server (FastAPI, uvicorn,
prometheus_client), which takes seconds; the modules that use them import them from here.
"""

DEFAULT_MAX_REQUEST_BODY_BYTES = 4 * 1024 * 1024  # a 128k-token prompt as JSON text is well under this
DEFAULT_HEADER_TIMEOUT_S = 20.0  # Apache's mod_reqtimeout allows 20 s for headers
DEFAULT_BODY_TIMEOUT_S = 60.0  # 4 MiB at 70 KB/s, a slow mobile link
DEFAULT_KEEP_ALIVE_S = 5.0  # uvicorn's default, and vLLM's (VLLM_HTTP_TIMEOUT_KEEP_ALIVE)
DEFAULT_METRICS_PREFIX = "tinyserve"
