"""The engine flags shared by `serve`, `run-batch` and the benchmarks."""

import argparse
import json
from pathlib import Path

from tinyserve.cli.lora_flags import add_lora_flags, lora_engine_kwargs
from tinyserve.cli.ray_flags import add_ray_engine_flags, ray_engine_kwargs
from tinyserve.config import CONVERTS, DTYPE_NAMES, KV_CACHE_DTYPE_NAMES, RUNNERS, EngineArgs
from tinyserve.kernels.backend import ATTENTION_BACKENDS
from tinyserve.structured_output import STRUCTURED_OUTPUT_BACKENDS


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", default=None,
                        help="a local Hugging Face model folder or a hub id in the local cache (default: the built-in model)")
    parser.add_argument("--model", dest="model_flag", metavar="MODEL", default=None,
                        help="the model, as a flag (vLLM's spelling); the same as the positional argument")
    group = parser.add_argument_group("engine")
    group.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    group.add_argument("--max-num-seqs", type=int, default=256, help="most requests running at once (default 256)")
    group.add_argument("--max-num-batched-tokens", type=int, default=2048,
                       help="token budget of one engine step; longer prompts are prefilled in chunks (default 2048)")
    group.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block (default 16)")
    group.add_argument("--num-kv-blocks", type=int, default=None,
                       help="KV-cache blocks per engine (default: from --kv-cache-memory)")
    group.add_argument("--kv-cache-memory", type=int, default=None,
                       help="bytes of KV cache per engine (default: 1 GiB on CPU; on CUDA, from --gpu-memory-utilization)")
    group.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                       help="on CUDA: the share of the GPU's memory this engine may use for weights, activations "
                            "and KV cache; the KV cache gets what the other two leave (default 0.9)")
    group.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                       help="reuse KV blocks of identical prompt prefixes (default on)")
    group.add_argument("--dtype", choices=sorted(DTYPE_NAMES), default="auto",
                       help="weights dtype, and the KV cache's unless --kv-cache-dtype says otherwise "
                            "(auto: float32 on CPU, the checkpoint's on GPU)")
    group.add_argument("--kv-cache-dtype", choices=list(KV_CACHE_DTYPE_NAMES), default="auto",
                       help="the KV cache's dtype (auto: the model's); a 16-bit cache under a float32 model "
                            "holds twice the tokens and halves what a decode step reads; fp8 = fp8_e4m3, with "
                            "per-tensor scales of 1.0")
    group.add_argument("--attention-backend", choices=ATTENTION_BACKENDS, default=None,
                       help="attention kernels: torch (the PyTorch reference), cpu (the reference with a numba decode "
                            "kernel over the paged cache, and the model's elementwise steps fused by numba), "
                            "triton (default: triton on CUDA, cpu on the CPU)")
    group.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                       help="split each engine's model over this many worker processes, one per device "
                            "(torch.distributed: gloo on CPU, NCCL on CUDA; default 1)")
    group.add_argument("--tensor-parallel-watchdog-timeout", type=float, default=30.0, metavar="SECONDS",
                       help="a rank that does not reach a collective within this many seconds (stopped, stuck) "
                            "fails the engine, named in the error (default 30; 0: never)")
    group.add_argument("--engine-iteration-timeout", type=float, default=300.0, metavar="SECONDS",
                       help="an engine holding requests that sends nothing for this many seconds (stopped, stuck in "
                            "a step) fails them, naming the stall, and is killed (vLLM's "
                            "VLLM_ENGINE_ITERATION_TIMEOUT_S; default 300, vLLM's bound on one step: longer than "
                            "a whole-budget prefill on a slow CPU, BENCHMARKS.md; 0: never)")
    group.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1,
                       help="split each engine's layers into this many stages, one process each (x the tensor-"
                            "parallel size), with up to this many batches in flight (default 1)")
    add_ray_engine_flags(group)
    group.add_argument("--seed", type=int, default=0, help="seed of the sampler for unseeded requests (default 0)")
    group.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    group.add_argument("--max-logprobs", type=int, default=20,
                       help="the most logprobs (or prompt logprobs) one request may ask for (default 20)")
    group.add_argument("--structured-outputs-backend", choices=[*STRUCTURED_OUTPUT_BACKENDS, "guidance"],
                       default="xgrammar", help="the grammar library that constrains structured outputs "
                                                "(default xgrammar; guidance is vLLM's name for llguidance)")
    group.add_argument("--structured-outputs-config", type=structured_outputs_config, default=None, metavar="JSON",
                       help='vLLM\'s structured-outputs config, {"backend": "xgrammar" | "guidance" | "llguidance" | '
                            '"auto"} (or --structured-outputs-config.backend xgrammar); its backend is '
                            "--structured-outputs-backend's")
    group.add_argument("--structured-outputs-compile-timeout", type=float, default=30.0, metavar="SECONDS",
                       help="a constrained request whose grammar is not compiled within this many seconds "
                            "fails with a 400 naming the limit (default 30; 0: no limit)")
    group.add_argument("--cpu-threads", type=int, default=None,
                       help="on CPU: threads of the forward pass, fixed (default: all the engine's cores, "
                            "fewer while other programs keep them busy)")
    group.add_argument("--enforce-eager", action="store_true",
                       help="on CUDA: run decode steps eagerly instead of replaying CUDA graphs")
    pooling = parser.add_argument_group("pooling (embeddings)")
    pooling.add_argument("--runner", choices=list(RUNNERS), default="auto",
                         help="generate: sample tokens (/v1/completions, /v1/chat/completions, ...); pooling: "
                              "compute one vector per input (/v1/embeddings, /pooling); auto: generate, unless "
                              "--convert embed (default auto)")
    pooling.add_argument("--convert", choices=list(CONVERTS), default="auto",
                         help="embed: serve the causal LM as an embedding model (implies --runner pooling)")
    pooling.add_argument("--pooler-config", type=json_object, default=None, metavar="JSON",
                         help='how a pooling model makes its vector: {"pooling_type": "LAST" | "MEAN" | "CLS", '
                              '"normalize": true | false} (default: LAST, L2-normalised)')
    spec = parser.add_argument_group("speculative decoding")
    spec.add_argument("--speculative-config", type=speculative_config, default=None, metavar="JSON",
                      help='propose several tokens a step and verify them in one pass (vLLM\'s): {"method": '
                           '"ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2} '
                           'or {"method": "draft_model", "model": PATH, "num_speculative_tokens": 3}')
    images = parser.add_argument_group("images (an image-text model: tinyserve/multimodal/)")
    images.add_argument("--max-num-encoder-input-tokens", type=int, default=None, metavar="ROWS",
                        help="image rows one step may encode (default: --max-num-batched-tokens, which vLLM always "
                             "uses; tinyserve's flag, to watch the budget spread images over steps)")
    images.add_argument("--encoder-cache-size", type=int, default=None, metavar="ROWS",
                        help="image rows the encoder cache holds (default 8192; tinyserve's flag)")
    events = parser.add_argument_group("KV cache events")
    events.add_argument("--kv-events-config", type=kv_events_config, default=None, metavar="JSON",
                        help='publish which KV blocks the engine holds, as vLLM does: {"enable_kv_cache_events": '
                             'true, "publisher": "zmq", "endpoint": "tcp://*:5557", "topic": ""} (ZeroMQ PUB of '
                             'msgpack KVEventBatches; with data parallelism rank R publishes on port + R)')
    disagg = parser.add_argument_group("disaggregated prefill")
    disagg.add_argument("--kv-transfer-config", type=kv_transfer_config, default=None, metavar="JSON",
                        help='send prompts\' K/V to, or receive them from, other engines (vLLM\'s): '
                             '{"kv_connector": "MooncakeConnector" | "ZmqConnector" (default: Mooncake where it '
                             'loads), "kv_role": "kv_producer" | "kv_consumer" | "kv_both", "kv_ip": HOST, '
                             '"kv_port": PORT, "kv_connector_extra_config": {"abort_request_timeout": S, '
                             '"transfer_timeout": S}}. Every prefill and decode server of a deployment shares '
                             'the secret in $TINYSERVE_KV_TRANSFER_SECRET: a decode server pulls only with '
                             'kv_transfer_params a prefill server holding it signed, and the side channel admits '
                             'only its holders (ZeroMQ CURVE); without it kv_transfer_params are refused')
    add_lora_flags(parser)


def kv_events_for_host(config: dict | None, host: str | None) -> dict | None:
    """The KV events sockets bind the server's --host (loopback by default), as its HTTP does."""
    if config is None:
        return None
    from tinyserve.kv_events.config import with_server_host

    return with_server_host(config, host)


# vLLM's StructuredOutputsConfig fields other than backend, with the values that ask for what tinyserve does
# (JSON is always constrained to compact whitespace; the engine constrains from the first token, and the
# reasoning parser is the API's --reasoning-parser, which refuses a constraint while the reasoning is open).
_STRUCTURED_OUTPUTS_CONFIG_AS_HERE = {
    "disable_any_whitespace": (False, True),  # vLLM's default, and what tinyserve always does
    "disable_additional_properties": (False,),
    "reasoning_parser": ("",),
    "reasoning_parser_plugin": ("",),
    "enable_in_reasoning": (False,),
}


def structured_outputs_config(text: str) -> dict:
    """--structured-outputs-config's JSON (vLLM's StructuredOutputsConfig): its backend is taken (auto is the
    default, xgrammar); any other field that would change an output is refused, naming it."""
    config = json_object(text)
    for name, value in config.items():
        if name == "backend":
            known = [*STRUCTURED_OUTPUT_BACKENDS, "guidance", "auto"]
            if value not in known:
                raise argparse.ArgumentTypeError(f"backend must be one of {known}, got {value!r}")
        elif name not in _STRUCTURED_OUTPUTS_CONFIG_AS_HERE:
            raise argparse.ArgumentTypeError(f"unknown field {name!r}; known: backend, "
                                             f"{', '.join(_STRUCTURED_OUTPUTS_CONFIG_AS_HERE)}")
        elif not any(value == ok and type(value) is type(ok) for ok in _STRUCTURED_OUTPUTS_CONFIG_AS_HERE[name]):
            raise argparse.ArgumentTypeError(f"{name}={value!r} is not implemented here")
    return config


def structured_outputs_backend(args: argparse.Namespace) -> str:
    """The grammar library: --structured-outputs-config's backend where given ("auto": xgrammar, the default),
    else --structured-outputs-backend."""
    backend = (getattr(args, "structured_outputs_config", None) or {}).get("backend")
    if backend is None:
        return args.structured_outputs_backend
    return "xgrammar" if backend == "auto" else backend


def kv_events_config(text: str) -> dict:
    """--kv-events-config's JSON, its fields checked (a usage error names the bad one)."""
    from tinyserve.kv_events.config import parse_kv_events_config

    try:
        return parse_kv_events_config(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def kv_transfer_config(text: str) -> dict:
    """--kv-transfer-config's JSON, its fields checked (a usage error names the bad one)."""
    from tinyserve.distributed.kv_transfer.config import KVTransferConfig

    config = json_object(text)
    try:
        KVTransferConfig.from_dict(config)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return config


def speculative_config(text: str) -> dict:
    """--speculative-config's JSON, its fields checked (a usage error names the bad one)."""
    from tinyserve.spec_decode.config import parse_speculative_config

    try:
        return parse_speculative_config(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def json_object(text: str) -> dict:
    """A flag's JSON object (argparse reports the ValueError as a usage error)."""
    value = json.loads(text)
    if not isinstance(value, dict):
        raise ValueError(f"not a JSON object: {text!r}")
    return value


def settle_model(args: argparse.Namespace) -> str | None:
    """Fold --model into args.model; returns a problem to report, or None."""
    if args.model_flag is not None:
        if args.model is not None and args.model != args.model_flag:
            return f"two models given: {args.model!r} and --model {args.model_flag!r}"
        args.model = args.model_flag
    names = getattr(args, "served_model_name", None) or []
    if args.model is None and len(names) > 1 and Path(names[-1]).is_dir():
        # --served-model-name takes one or more names, so a model folder after it is read as one.
        return (f"{names[-1]!r} was read as a --served-model-name; put the model before the flags, "
                "or pass it as --model")
    return None


def engine_args_from(args: argparse.Namespace) -> EngineArgs:
    engine_args = EngineArgs(
        model=args.model,
        num_kv_blocks=args.num_kv_blocks,
        kv_cache_memory=args.kv_cache_memory,
        gpu_memory_utilization=args.gpu_memory_utilization,
        block_size=args.block_size,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        enable_prefix_caching=args.enable_prefix_caching,
        attention_backend=args.attention_backend,
        dtype=args.dtype,
        kv_cache_dtype=args.kv_cache_dtype,
        seed=args.seed,
        device=args.device,
        enforce_eager=args.enforce_eager,
        cpu_threads=args.cpu_threads,
        max_logprobs=args.max_logprobs,
        tensor_parallel_size=args.tensor_parallel_size,
        tensor_parallel_watchdog_s=args.tensor_parallel_watchdog_timeout,
        engine_iteration_timeout_s=args.engine_iteration_timeout,
        pipeline_parallel_size=args.pipeline_parallel_size,
        structured_outputs_backend=structured_outputs_backend(args),
        structured_outputs_compile_timeout=args.structured_outputs_compile_timeout,
        runner=args.runner,
        convert=args.convert,
        pooler_config=args.pooler_config,
        speculative_config=getattr(args, "speculative_config", None),
        kv_events_config=kv_events_for_host(getattr(args, "kv_events_config", None), getattr(args, "host", None)),
        kv_transfer_config=getattr(args, "kv_transfer_config", None),
        enable_prompt_embeds=getattr(args, "enable_prompt_embeds", False),  # vLLM's flag (vllm_flags.py)
        limit_mm_per_prompt=getattr(args, "limit_mm_per_prompt", None),  # vLLM's flag (vllm_flags.py)
        allowed_local_media_path=getattr(args, "allowed_local_media_path", None),  # vLLM's (vllm_flags.py)
        allowed_media_domains=getattr(args, "allowed_media_domains", None),  # vLLM's (vllm_flags.py)
        chat_template_content_format=getattr(args, "chat_template_content_format", "auto"),  # vLLM's too
        max_num_encoder_input_tokens=args.max_num_encoder_input_tokens,
        encoder_cache_size=args.encoder_cache_size,
        **lora_engine_kwargs(args),
        **ray_engine_kwargs(args),
    )
    from tinyserve.assemble import check_engine_args

    return check_engine_args(engine_args)  # the core's checks, then each layer's
