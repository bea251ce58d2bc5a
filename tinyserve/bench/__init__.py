"""Benchmarks, as vLLM defines them.

    tinyserve bench throughput   offline: one LLM in this process, every prompt at once;
                                 requests/s and tokens/s (throughput.py)
    tinyserve bench serve        online: an async load generator against any
                                 OpenAI-compatible server; TTFT, TPOT, ITL, E2EL,
                                 throughput and goodput (serve.py, request_funcs.py,
                                 metrics.py)

Both draw their prompts from the same random dataset (datasets.py): random token ids of
lengths spread around a mean, so the numbers measure the engine, not the text.
"""
