"""Engine arguments (named like the CLI flags) and what they resolve to for one model.

`EngineArgs` is what a user passes: `LLM(model, **engine_args)` or `tinyserve serve
--flag`. `ModelInfo` is what both processes need to know about the model without
loading its weights: where it lives, its vocabulary, its context length, its
end-of-sequence tokens. Prompts are validated against it at the boundary.

Every core argument is checked here, beside its field, so that a bad value fails before
any process starts. A layer's own arguments (speculative decoding, pipeline parallelism,
LoRA, KV events, a KV connector, Ray) are fields here too, but their checks live in the
layer (its layer.py's `check_args`): tinyserve/assemble.py's `check_engine_args` runs
`validate` and then them. This module imports no layer. It is over 300 lines because
EngineArgs holds every engine flag, each field beside the comment that says what it does,
in one place where a reader finds them all.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING

from tinyserve.dtypes import DTYPE_NAMES, KV_CACHE_DTYPE_NAMES, resolve_dtype, torch_dtypes
from tinyserve.errors import InvalidInputError
from tinyserve.utils import cdiv

if TYPE_CHECKING:  # torch is imported where used: the command line reads EngineArgs without it
    import torch

RUNNERS = ("auto", "generate", "pooling")  # --runner, as vLLM's
CONVERTS = ("auto", "none", "embed")  # --convert, the ones that apply to a causal LM here
POOLING_TYPES = ("LAST", "MEAN", "CLS")  # --pooler-config's pooling_type (engine/worker/pooling_runner.py)
DEFAULT_KV_CACHE_MEMORY = 1 << 30  # bytes of KV cache when neither a block count nor a budget is given

logger = logging.getLogger(__name__)


def __getattr__(name: str):  # DTYPES, KV_CACHE_DTYPES: torch is imported on first use (cli/ builds no torch)
    if name not in ("DTYPES", "KV_CACHE_DTYPES"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = torch_dtypes(DTYPE_NAMES if name == "DTYPES" else KV_CACHE_DTYPE_NAMES)
    return globals()[name]


@dataclass(slots=True)
class EngineArgs:
    model: str | None = None  # None: the built-in default model
    num_kv_blocks: int | None = None
    kv_cache_memory: int | None = None  # bytes for the KV pool, when num_kv_blocks is not given
    gpu_memory_utilization: float = 0.9  # on CUDA, without either of the above: this share of the GPU
    block_size: int = 16
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    enable_prefix_caching: bool = True
    attention_backend: str | None = None  # None: triton on CUDA, cpu on the CPU (kernels/backend.py)
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"  # the KV pool's dtype (KV_CACHE_DTYPES); auto: the model's
    seed: int = 0
    device: str | None = None  # None: cuda if available, else cpu
    enforce_eager: bool = False  # on CUDA: no CUDA graphs for decode steps
    # On CPU: the forward pass's threads. None: all the engine's cores, fewer while other
    # programs take them away (engine/worker/cpu_threads.py); a number fixes the count.
    cpu_threads: int | None = None
    scheduling_policy: str = "fcfs"
    max_logprobs: int = 20  # the most logprobs / prompt_logprobs one request may ask for (vLLM's default); -1: all
    tensor_parallel_size: int = 1  # ranks each engine's model is split over (worker/tensor_parallel_workers.py)
    # The tensor-parallel path even at size 1: a one-rank process group, its all-reduces
    # included (benchmarks/gpu_check.py runs NCCL so on a machine with one GPU).
    force_tensor_parallel: bool = False
    # A rank that does not reach a collective in this many seconds fails the engine, named (tp_watchdog.py); 0: off
    tensor_parallel_watchdog_s: float = 30.0
    # An engine with requests that sends nothing for this long is failed, named, and killed (engine_watchdog.py); 0: off
    engine_iteration_timeout_s: float = 300.0
    # Stages each engine's layers are split over, one process (group) each, up to this many batches in
    # flight (tinyserve/pipeline_parallel/); vLLM's pipeline_parallel_size.
    pipeline_parallel_size: int = 1
    distributed_executor_backend: str = "mp"  # ranks 1..N-1 as "mp" processes or "ray" actors (distributed/)
    ray_resources: dict | None = None  # custom Ray resources each actor's bundle asks for, e.g. {"node_b": 1}
    structured_outputs_backend: str = "xgrammar"  # the grammar library: xgrammar or llguidance
    # Seconds a constrained request may wait for its grammar to compile; past them it fails with a 400 (0: no limit)
    structured_outputs_compile_timeout: float = 30.0
    # What a step makes of its hidden states (vLLM's --runner): "generate" samples tokens, "pooling"
    # pools them into a vector per request (engine/worker/pooling_runner.py). "auto": generate,
    # unless --convert embed asks for the model as an embedding model.
    runner: str = "auto"
    convert: str = "auto"  # "embed": serve the causal LM as an embedding model (pooling); "none"/"auto": as it is
    # --pooler-config: {"pooling_type": "LAST" | "MEAN" | "CLS", "normalize": bool}; default LAST, normalised
    pooler_config: dict | None = None
    # Tracing of the engine process(es): the run folder for engine-<i>.jsonl, and/or an OTLP/HTTP endpoint.
    trace_run_dir: str | None = None
    otlp_endpoint: str | None = None
    trace_max_bytes: int | None = None  # --trace-max-mb: the run folder's cap (otlp_capped.py)
    # LoRA adapters (tinyserve/lora/), vLLM's names: max_loras resident at once (and running at once),
    # each of rank up to max_lora_rank; max_cpu_loras kept loaded in memory (None: max_loras).
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    # vLLM's --enable-prompt-embeds: prompts may come as embeddings (tinyserve/prompt_embeds/); off, a 400
    enable_prompt_embeds: bool = False
    # vLLM's --limit-mm-per-prompt: the most images a prompt may carry ({"image": N}; tinyserve/multimodal/)
    limit_mm_per_prompt: dict | None = None
    # vLLM's --allowed-local-media-path, --allowed-media-domains: where a chat's image URLs may lead (media.py)
    allowed_local_media_path: str | None = None
    allowed_media_domains: list[str] | None = None
    # vLLM's --chat-template-content-format: how the chat template takes a message's content ("auto": as its
    # syntax says, frontend/chat_messages.py; "string"; "openai", a list of parts)
    chat_template_content_format: str = "auto"
    # The image rows a step may encode (None: max_num_batched_tokens, as vLLM always has it), and the rows the
    # encoder cache holds (None: 8192); tinyserve/multimodal/scheduling.py. vLLM's names, tinyserve's flags.
    max_num_encoder_input_tokens: int | None = None
    encoder_cache_size: int | None = None
    # Speculative decoding (tinyserve/spec_decode/), vLLM's --speculative-config: {"method": "ngram",
    # "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2} or {"method":
    # "draft_model", "model": PATH, "num_speculative_tokens": 3}. None: one token per step.
    speculative_config: dict | None = None
    # KV cache events (tinyserve/kv_events/), vLLM's --kv-events-config: {"enable_kv_cache_events": true,
    # "publisher": "zmq", "endpoint": "tcp://*:5557", "topic": ""}. None: no events.
    kv_events_config: dict | None = None
    # Disaggregated prefill, vLLM's --kv-transfer-config (distributed/kv_transfer/config.py). None: no KV connector.
    kv_transfer_config: dict | None = None

    @classmethod
    def from_kwargs(cls, **kwargs) -> "EngineArgs":
        known = {f.name for f in fields(cls)}
        if unknown := sorted(set(kwargs) - known):
            raise ValueError(f"unknown engine argument(s) {unknown}; valid ones are {sorted(known)}")
        args = cls(**kwargs)
        args.validate()
        return args

    def validate(self) -> None:
        """The core's fields (a layer's flags: tinyserve/assemble.py's check_engine_args runs this, then them)."""
        for name in ("block_size", "max_num_batched_tokens", "max_num_seqs", "tensor_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        for name in ("tensor_parallel_watchdog_s", "engine_iteration_timeout_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be non-negative (0: off), got {getattr(self, name)}")
        if self.structured_outputs_compile_timeout < 0:
            raise ValueError(f"structured_outputs_compile_timeout must be non-negative (0: no limit), got "
                             f"{self.structured_outputs_compile_timeout}")
        if self.max_logprobs < -1:
            raise ValueError(f"max_logprobs must be non-negative, or -1 for the whole vocabulary, "
                             f"got {self.max_logprobs}")
        for name in ("num_kv_blocks", "kv_cache_memory", "max_model_len", "cpu_threads"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.attention_backend == "triton":
            from tinyserve import extras

            extras.require("attention_backend='triton' (on a CPU, through Triton's interpreter)", "triton")
        from tinyserve.structured_output import BACKEND_ALIASES, get_backend_module

        self.structured_outputs_backend = BACKEND_ALIASES.get(self.structured_outputs_backend,
                                                              self.structured_outputs_backend)  # vLLM's "guidance"
        get_backend_module(self.structured_outputs_backend)  # a clear error if unknown or not installed
        self._validate_runner()
        if self.dtype not in DTYPE_NAMES:
            raise ValueError(f"dtype must be one of {sorted(DTYPE_NAMES)}, got {self.dtype!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPE_NAMES:
            raise ValueError(f"kv_cache_dtype must be one of {list(KV_CACHE_DTYPE_NAMES)}, got {self.kv_cache_dtype!r}")

    def _validate_runner(self) -> None:
        """--runner, --convert and --pooler-config, resolved: runner becomes "generate" or "pooling"."""
        if self.runner not in RUNNERS:
            raise ValueError(f"runner must be one of {list(RUNNERS)}, got {self.runner!r}")
        if self.convert not in CONVERTS:
            raise ValueError(f"convert must be one of {list(CONVERTS)}, got {self.convert!r} "
                             "(classification models are not supported)")
        if self.runner == "auto":
            self.runner = "pooling" if self.convert == "embed" else "generate"
        if self.convert == "embed" and self.runner != "pooling":
            raise ValueError("convert='embed' makes an embedding model: it needs runner='pooling' (or 'auto')")
        if self.runner != "pooling":
            if self.pooler_config is not None:
                raise ValueError("pooler_config is for runner='pooling' (an embedding model); this engine generates")
            return
        config = {"pooling_type": "LAST", "normalize": True, **(self.pooler_config or {})}
        if unknown := sorted(set(config) - {"pooling_type", "normalize"}):
            raise ValueError(f"pooler_config: unknown field(s) {unknown}; known: pooling_type, normalize")
        if str(config["pooling_type"]).upper() not in POOLING_TYPES:
            raise ValueError(f"pooler_config.pooling_type must be one of {list(POOLING_TYPES)}, "
                             f"got {config['pooling_type']!r}")
        if not isinstance(config["normalize"], bool):
            raise ValueError(f"pooler_config.normalize must be true or false, got {config['normalize']!r}")
        config["pooling_type"] = config["pooling_type"].upper()
        self.pooler_config = config
        if self.tensor_parallel_size > 1 or self.force_tensor_parallel:
            raise ValueError("runner='pooling' runs on one rank: tensor_parallel_size must be 1")
        if self.enable_lora:
            raise ValueError("enable_lora is for runner='generate': a pooling engine serves the base model only")
        if config["pooling_type"] != "LAST" and self.enable_prefix_caching:
            # MEAN and CLS read every position's hidden state: a cached prefix has none to read.
            logger.info("pooling_type %s pools every position: prefix caching is turned off", config["pooling_type"])
            self.enable_prefix_caching = False
    @property
    def torch_device(self) -> torch.device:
        import torch

        if self.device is not None:
            return torch.device(self.device)
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@dataclass(slots=True)
class ModelInfo:
    path: Path
    model_type: str
    vocab_size: int
    max_model_len: int
    eos_token_ids: list[int]
    torch_dtype: torch.dtype
    kv_cache_dtype: torch.dtype  # the KV pool's: torch_dtype unless --kv-cache-dtype says otherwise
    # Sampling defaults from the checkpoint's generation_config.json, under SamplingParams'
    # names: used where a request leaves a parameter out (vLLM's generation_config="auto").
    generation_defaults: dict = field(default_factory=dict)
    hidden_size: int = 0  # the width of the model's input embeddings (a prompt given as embeddings must match)
    image_token_id: int | None = None  # an image-text checkpoint's image placeholder (tinyserve/multimodal/)

    @classmethod
    def from_args(cls, args: EngineArgs) -> "ModelInfo":
        from tinyserve.models.default_model import default_model_path
        from tinyserve.models.pipeline_parallel import PipelineStage
        from tinyserve.models.loader import check_architecture, resolve_model_path, text_config

        path = default_model_path() if args.model is None else resolve_model_path(args.model)
        whole = _read_json(path / "config.json")
        check_architecture(whole, path)
        config = text_config(whole)  # an image-text checkpoint's language model (models/loader.py)
        generation_file = path / "generation_config.json"
        generation_config = _read_json(generation_file) if generation_file.exists() else {}
        max_position = config.get("max_position_embeddings") or 2048
        max_model_len = args.max_model_len or max_position
        if max_model_len > max_position:
            raise ValueError(f"max_model_len {max_model_len} exceeds the model's max_position_embeddings {max_position}")
        if args.pipeline_parallel_size > 1:  # more stages than layers, refused before any process starts
            PipelineStage.of(0, args.pipeline_parallel_size, config["num_hidden_layers"])
        torch_dtype = resolve_dtype(args.dtype, args.torch_device, config)
        if generation_defaults := _generation_defaults(generation_config):
            logger.info("sampling defaults from the model's generation_config.json: %s", generation_defaults)
        return cls(
            path=path,
            model_type=config.get("model_type", ""),
            vocab_size=config["vocab_size"],
            max_model_len=max_model_len,
            eos_token_ids=_eos_token_ids(generation_config, config),
            image_token_id=whole.get("image_token_index") if whole is not config else None,
            torch_dtype=torch_dtype,
            kv_cache_dtype=torch_dtypes(KV_CACHE_DTYPE_NAMES)[args.kv_cache_dtype] or torch_dtype,
            generation_defaults=generation_defaults, hidden_size=config.get("hidden_size", 0),
        )

    def validate_prompt(self, prompt_token_ids: list[int], max_tokens: int | None = None) -> None:
        """Raise ValueError naming the problem if this prompt cannot be served."""
        if not prompt_token_ids:
            raise InvalidInputError("prompt must not be empty", "prompt")
        if len(prompt_token_ids) > self.max_model_len:
            raise InvalidInputError(
                f"prompt has {len(prompt_token_ids)} tokens, more than max_model_len={self.max_model_len} "
                f"(by {len(prompt_token_ids) - self.max_model_len})", "prompt",
            )
        if bad := [t for t in prompt_token_ids if not (isinstance(t, int) and 0 <= t < self.vocab_size)]:
            raise InvalidInputError(
                f"prompt_token_ids contains ids outside the vocabulary [0, {self.vocab_size}): {bad[:5]}", "prompt")


def check_kv_fit(num_prompt_tokens: int, max_tokens: int | None, max_model_len: int, block_size: int, num_kv_blocks: int) -> None:
    """Raise ValueError if one request could outgrow the whole KV pool (it would wait forever)."""
    longest = min(num_prompt_tokens + (max_tokens or max_model_len), max_model_len)
    needed = cdiv(longest, block_size)
    if needed > num_kv_blocks:
        raise ValueError(
            f"request needs up to {needed} KV blocks ({longest} tokens) but the pool has only {num_kv_blocks}; "
            f"lower max_tokens or raise num_kv_blocks"
        )


def _eos_token_ids(generation_config: dict, config: dict) -> list[int]:
    """End-of-sequence ids from generation_config.json (preferred) or config.json."""
    eos = generation_config.get("eos_token_id")
    if eos is None:
        eos = config.get("eos_token_id")
    if eos is None:
        return []
    return [eos] if isinstance(eos, int) else list(eos)


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not valid JSON: {error}") from None


GENERATION_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def _generation_defaults(generation_config: dict) -> dict:
    """The sampling settings generation_config.json sets (max_new_tokens becomes max_tokens), as vLLM reads them."""
    defaults = {key: generation_config[key] for key in GENERATION_DEFAULT_KEYS
                if generation_config.get(key) is not None}
    if generation_config.get("max_new_tokens") is not None:
        defaults["max_tokens"] = generation_config["max_new_tokens"]
    return defaults

