"""Images as a layer of the engine (an image-text checkpoint: LLaVA), at its seams.

    enabled      the model is an image-text checkpoint (models/loader.py's WITH_IMAGES): its
                 language model is the engine's model, and this layer adds its image encoder
    check_args   --limit-mm-per-prompt's form ({"image": N}); tensor and pipeline parallelism
                 refused (not yet: their other ranks would look the placeholders up)
    attach       the image encoder (vision.py) loaded from the checkpoint; one of the model
                 runner's embeds_hooks: each image's rows at its placeholder positions, through the
                 encoder cache (inputs.py); one of the scheduler's token_limits: the encoder budget
                 per step and what the cache keeps (scheduling.py); span attributes: a request's
                 images (their content hashes and placeholder runs) on its queue span, and each
                 step's images encoded, encoder cache hits and encoding time on the step span
                 (lifecycle/schema.py's MM_*), and a tinyserve.encode span inside the step's execute where it
                 encoded (its images, their rows and hashes); the encoder cache's counters on every step's
                 SchedulerStats (vLLM's mm_cache_queries, mm_cache_hits on /metrics: metrics.py)

The front end reads a chat's image parts (chat.py, media.py: --allowed-local-media-path and
--allowed-media-domains, checked here) and runs the checkpoint's processor (processor.py), both
called by frontend/render.py; the scheduler counts an image's placeholders as the prompt's tokens,
and the prefix cache keys each block an image's placeholders cover by the image's hash (engine/core/request.py's
block_extra_key). The step itself does not change.
"""

import json
import os

from tinyserve.engine.layers import AssemblyContext, EngineHooks, EngineLayer, EngineParts

ENCODER_CACHE_ROWS = 8192  # the encoder cache's default size, in rows: fourteen LLaVA-1.5 images (576 rows each)


def has_images(args) -> bool:
    from tinyserve.models.default_model import default_model_path
    from tinyserve.models.loader import WITH_IMAGES, resolve_model_path

    path = default_model_path() if args.model is None else resolve_model_path(args.model)
    try:
        return json.loads((path / "config.json").read_text()).get("model_type") in WITH_IMAGES
    except (OSError, json.JSONDecodeError):  # ModelInfo says what is wrong with it
        return False


class MultiModalLayer(EngineLayer):
    name = "multimodal"

    def check_args(self, args) -> None:
        limit = args.limit_mm_per_prompt
        if limit is not None and (not isinstance(limit, dict) or set(limit) - {"image"} or not all(
                isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in limit.values())):
            raise ValueError(f"limit_mm_per_prompt (--limit-mm-per-prompt) takes {{\"image\": N}}, N >= 0; got "
                             f"{limit!r}")
        for name in ("max_num_encoder_input_tokens", "encoder_cache_size"):
            value = getattr(args, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"{name} must be a whole number of image rows, at least 1; got {value!r}")
        folder = args.allowed_local_media_path
        if folder is not None and not os.path.isdir(folder):
            raise ValueError(f"allowed_local_media_path (--allowed-local-media-path) must be a folder that exists, "
                             f"got {folder!r}")
        domains = args.allowed_media_domains
        if domains is not None and (not isinstance(domains, list) or not all(
                isinstance(d, str) and d and "/" not in d for d in domains)):
            raise ValueError(f"allowed_media_domains (--allowed-media-domains) takes host names, got {domains!r}")
        if (args.tensor_parallel_size > 1 or args.pipeline_parallel_size > 1) and has_images(args):
            raise ValueError("an image-text model is not served with tensor or pipeline parallelism "
                             "(tensor_parallel_size, pipeline_parallel_size) yet")

    def enabled(self, args) -> bool:
        return has_images(args)

    def attach(self, ctx: AssemblyContext, engine_parts: EngineParts, hooks: EngineHooks) -> None:
        from transformers import AutoConfig

        from tinyserve.lifecycle import schema
        from tinyserve.lifecycle.request_spans import image_attributes
        from tinyserve.multimodal.inputs import EncoderCache, ImageInputs
        from tinyserve.multimodal.scheduling import EncoderBudget
        from tinyserve.multimodal.vision import load_image_encoder
        from tinyserve.wire.messages import MultiModalCacheStats

        info = ctx.model_info
        encoder = load_image_encoder(info.path, AutoConfig.from_pretrained(info.path), info.torch_dtype,
                                     ctx.args.torch_device)
        args = ctx.args
        cache = EncoderCache(args.encoder_cache_size or ENCODER_CACHE_ROWS)
        inputs = ImageInputs(engine_parts.model, encoder, cache)
        engine_parts.model_runner.embeds_hooks.append(inputs)
        engine_parts.scheduler.token_limits.append(
            EncoderBudget(cache, args.max_num_encoder_input_tokens or args.max_num_batched_tokens))
        hooks.parts[self.name] = inputs

        def request_attributes(request) -> dict:
            return image_attributes(request.mm_features)

        def step_attributes(scheduler_output) -> dict:
            step = inputs.last_step
            if not step["encoded"] and not step["hits"]:
                return {}
            return {schema.STEP_MM_IMAGES_ENCODED: step["encoded"], schema.STEP_MM_ENCODER_CACHE_HITS: step["hits"],
                    schema.STEP_MM_ENCODE_TIME: step["encode_s"]}

        def encode_span(scheduler_output) -> list[tuple]:
            step = inputs.last_step
            if not step["encoded"]:
                return []
            return [(schema.ENCODE, step["started_at"], step["started_at"] + step["encode_s"], {
                schema.STEP_MM_IMAGES_ENCODED: step["encoded"], schema.MM_ENCODER_TOKENS: step["rows"],
                schema.MM_HASHES: step["hashes"]})]

        def cache_counters(stats) -> None:
            stats.mm_cache_stats = MultiModalCacheStats(cache.queries, cache.hits)

        hooks.scheduler_stats.append(cache_counters)
        hooks.request_attributes.append(request_attributes)
        hooks.step_attributes.append(step_attributes)
        hooks.step_spans.append(encode_span)
