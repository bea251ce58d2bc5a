"""The LoRA flags, named as vLLM's: the engine's (`serve`, `run-batch`, the benchmarks) and the server's.

    --enable-lora --max-loras 2 --max-lora-rank 16 --max-cpu-loras 4      engine
    --lora-modules sql=/adapters/sql chat=/adapters/chat                   serve: the adapters by name

A request's `model` names an adapter of --lora-modules (or one loaded at run time through
/v1/load_lora_adapter, which TINYSERVE_ALLOW_RUNTIME_LORA_UPDATING=true, or vLLM's
VLLM_ALLOW_RUNTIME_LORA_UPDATING=True, turns on).
"""

import argparse


def add_lora_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("LoRA adapters (tinyserve/lora/)")
    group.add_argument("--enable-lora", action="store_true",
                       help="serve LoRA adapters in PEFT's format beside the base model, mixed in one batch")
    group.add_argument("--max-loras", type=int, default=1,
                       help="adapters resident at once, and running at once (default 1)")
    group.add_argument("--max-lora-rank", type=int, default=16,
                       help="the highest adapter rank accepted; a higher one is refused, named (default 16)")
    group.add_argument("--max-cpu-loras", type=int, default=None,
                       help="adapters kept loaded in memory, least recently used dropped first "
                            "(default: --max-loras)")


def add_lora_modules_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                        help="adapters served by name (the request's model): name=path, or JSON "
                             "'{\"name\": ..., \"path\": ...}'; needs --enable-lora")


def lora_engine_kwargs(args: argparse.Namespace) -> dict:
    """EngineArgs' LoRA fields; ValueError for --lora-modules without --enable-lora (before any engine starts)."""
    if getattr(args, "lora_modules", None) and not getattr(args, "enable_lora", False):
        raise ValueError("--lora-modules needs --enable-lora")
    return {"enable_lora": getattr(args, "enable_lora", False), "max_loras": getattr(args, "max_loras", 1),
            "max_lora_rank": getattr(args, "max_lora_rank", 16), "max_cpu_loras": getattr(args, "max_cpu_loras", None)}


def lora_registry_from(args: argparse.Namespace, engine_args, model_path, base_model_name: str):
    """The server's adapters by name (None without --enable-lora); ValueError naming a bad --lora-modules."""
    from tinyserve.lora.registry import LoRAChecker, LoRARegistry, parse_lora_modules

    modules = parse_lora_modules(args.lora_modules or [])
    if not engine_args.enable_lora:
        if modules:
            raise ValueError("--lora-modules needs --enable-lora")
        return None
    # --api-server-count N: one table for all the API processes (cli/api_servers.py names its file)
    registry = LoRARegistry(LoRAChecker.from_engine_args(model_path, engine_args), base_model_name,
                            shared_file=getattr(args, "lora_registry_file", None))
    for name, path in modules:
        registry.add(name, path, exist_ok=True)
    return registry
