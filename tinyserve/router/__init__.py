"""The router: one OpenAI endpoint in front of several `tinyserve serve` backends (its own process).

    backends.py     each backend's URL, health and load (in flight through the router, ORCA, /load)
    health.py       the health checks that take a backend out and bring it back
    policies.py     which backend gets a request, and why: round_robin, least_load
    prefix_aware.py prefix-aware: the backend already holding the longest prefix of the prompt
    kv_index.py     what each backend holds, from its KV cache events (ZeroMQ, vLLM's format)
    proxy.py        forwarding one request and passing its answer back as it arrives (SSE too)
    app.py          the FastAPI app: the proxied routes, /health, the router's spans, the server's guards
    defaults.py     the flags' defaults, importable without the app

`tinyserve router` (cli/router.py) builds a `Router` (app.py) from a list of backends and a
policy and serves it. A request is handled by `Router.dispatch`: the policy picks a backend,
the proxy forwards. A mode that needs more than one backend per request (prefill/decode
disaggregation, pd.py) is another `Dispatcher` in the same place: app.py calls whatever
`dispatch` the CLI built, and never branches on the mode.
"""
