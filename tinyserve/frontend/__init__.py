"""Runs in the API process (or in the caller's, for the offline LLM): the front end.

Stages ② render (input_processor), ③ enqueue (async_llm, llm_engine), ④ send and ⑦
receive through an engine client (core_client for engine processes, inproc_client for
an engine in this process), ⑧ detokenize (output_processor, detokenizer). Nothing here
runs the model; what crosses to the engine is defined in `tinyserve.wire`.
"""
