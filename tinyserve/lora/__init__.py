"""LoRA adapters, as a layer beside the base model (vLLM's interface).

    layer.py        the layer: its flags checked, and what it attaches to an engine as it is assembled
    request.py      LoRARequest (tinyserve/lora_request.py, it crosses the wire), one per prompt for LLM
    peft_format.py  read and check an adapter saved in PEFT's format
    layers.py       LoRALinear: a model Linear plus every resident adapter's low-rank product
    manager.py      the worker's resident adapters: max_loras slots, max_cpu_loras loaded, LRU
    scheduling.py   the scheduler's admission gate: at most max_loras adapters running at once
    registry.py     the front end's named adapters (--lora-modules, load/unload at run time)

The rest of tinyserve meets this layer only at seams: a field on the request and on
NewRequestData, an input hook of the model runner, an admission gate of the scheduler,
a request check and a utility of the engine, and the prefix cache's root hash
(docs/design.md, "LoRA adapters").
"""
