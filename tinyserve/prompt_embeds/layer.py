"""Prompt embeddings as a layer of the engine (`--enable-prompt-embeds`), at its seams.

    check_args   tensor and pipeline parallelism refused (not yet: their other ranks' runners
                 would look the placeholder ids up)
    attach       the model runner's embeds_hooks: the rows of prompts given as embeddings in place
                 of the embedding lookup (inputs.py); span attributes: the rows and their width on
                 the request's queue span (lifecycle/schema.py's PROMPT_EMBEDS_*)

The front end checks and packs the embeddings (tensors.py, called by frontend/render.py); the scheduler
counts their rows as the prompt's tokens, and the prefix cache keys their blocks by a hash of the rows
(engine/core/request.py's block_hash_root). The step itself does not change.
"""

from tinyserve.engine.layers import AssemblyContext, EngineHooks, EngineLayer, EngineParts


class PromptEmbedsLayer(EngineLayer):
    name = "prompt_embeds"

    def check_args(self, args) -> None:
        if not args.enable_prompt_embeds:
            return
        if args.tensor_parallel_size > 1 or args.force_tensor_parallel:
            raise ValueError("enable_prompt_embeds is not supported with tensor parallelism (tensor_parallel_size > 1) "
                             "yet")
        if args.pipeline_parallel_size > 1:
            raise ValueError("enable_prompt_embeds is not supported with pipeline parallelism "
                             "(pipeline_parallel_size > 1) yet")

    def enabled(self, args) -> bool:
        return args.enable_prompt_embeds

    def attach(self, ctx: AssemblyContext, engine_parts: EngineParts, hooks: EngineHooks) -> None:
        from tinyserve.lifecycle import schema
        from tinyserve.prompt_embeds.inputs import PromptEmbedsInputs

        engine_parts.model_runner.embeds_hooks.append(PromptEmbedsInputs(engine_parts.model))

        def request_attributes(request) -> dict:
            embeds = request.prompt_embeds
            if embeds is None:
                return {}
            return {schema.PROMPT_EMBEDS_ROWS: embeds.rows, schema.PROMPT_EMBEDS_HIDDEN_SIZE: embeds.hidden_size}

        hooks.request_attributes.append(request_attributes)
