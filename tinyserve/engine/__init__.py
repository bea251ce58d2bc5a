"""Runs in an engine process (one per data-parallel rank), or in the caller's for the offline LLM.

engine_core.py is one step (schedule → execute → update); engine_core_proc.py the
process around it: its busy loop and socket threads. Below it, core/ decides (the
scheduler and the paged KV cache: plain Python, no torch) and worker/ computes (the
model runner and the sampler, which read only the step's SchedulerOutput).
"""
