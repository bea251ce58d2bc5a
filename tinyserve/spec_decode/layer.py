"""Speculative decoding as a layer of the engine (`--speculative-config`), at its seams.

    check_args        --speculative-config's fields, and what it does not combine with
    scheduler_class   SpecDecodeScheduler: drafts counted in the budget and the KV slots; rollback (scheduler.py)
    runner_class      SpecDecodeModelRunner: verify, roll back, propose (model_runner.py), with its proposer:
                      NgramProposer (ngram_proposer.py) or DraftModelProposer (draft_model_proposer.py)
    attach            a request check: structured outputs are refused (one grammar state per step);
                      step attributes: drafts, accepted tokens, the blocks rollbacks freed, the time proposing
                      and verifying (only on steps that ran a forward pass);
                      finish attributes: a request's drafts proposed, accepted, rejected, on its decode span

The assembly (tinyserve/assemble.py) asks for these while it builds the engine; the step itself
does not change.
"""

import functools

from tinyserve.engine.layers import AssemblyContext, EngineHooks, EngineLayer, EngineParts
from tinyserve.spec_decode.config import SpeculativeConfig, check_draft_vocabulary


class SpecDecodeLayer(EngineLayer):
    name = "spec_decode"

    def check_args(self, args) -> None:
        if args.speculative_config is None:
            return
        SpeculativeConfig.from_dict(args.speculative_config)
        if args.runner == "pooling" or args.convert == "embed":
            raise ValueError("speculative_config is for runner='generate': a pooling engine samples no tokens")
        if args.tensor_parallel_size > 1 or args.force_tensor_parallel:
            raise ValueError("speculative_config is not supported with tensor parallelism (tensor_parallel_size > 1)")
        if args.enable_lora:
            raise ValueError("speculative_config is not supported with enable_lora")

    def enabled(self, args) -> bool:
        return args.speculative_config is not None

    def scheduler_class(self, ctx: AssemblyContext, scheduler_class, model_runner):
        from tinyserve.spec_decode.scheduler import SpecDecodeScheduler

        k = SpeculativeConfig.from_dict(ctx.args.speculative_config).num_speculative_tokens
        return functools.partial(SpecDecodeScheduler, num_speculative_tokens=k)

    def runner_class(self, ctx: AssemblyContext, runner_class):
        """The speculative runner, with its proposer; a draft model is read here, at start-up."""
        from tinyserve.spec_decode.model_runner import SpecDecodeModelRunner

        config = SpeculativeConfig.from_dict(ctx.args.speculative_config)
        if config.method == "draft_model":
            check_draft_vocabulary(config.draft_path(), ctx.model_info.vocab_size)
        return functools.partial(SpecDecodeModelRunner, make_proposer=functools.partial(make_proposer, ctx, config),
                                 num_speculative_tokens=config.num_speculative_tokens)

    def attach(self, ctx: AssemblyContext, engine_parts: EngineParts, hooks: EngineHooks) -> None:
        """The request check and the span attributes (lifecycle/schema.py's SPEC_DECODE_*)."""
        from tinyserve.lifecycle import schema

        scheduler, runner = engine_parts.scheduler, engine_parts.model_runner
        hooks.request_checks.append(check_speculative_request)

        def step_attributes(scheduler_output) -> dict:
            verified, freed = scheduler.last_verified, scheduler.last_freed
            attributes = {
                schema.STEP_SPEC_REQUEST_IDS: list(verified),
                schema.STEP_SPEC_NUM_PROPOSED: [proposed for proposed, _ in verified.values()],
                schema.STEP_SPEC_NUM_ACCEPTED: [accepted for _, accepted in verified.values()],
                schema.STEP_SPEC_NUM_REJECTED: [proposed - accepted for proposed, accepted in verified.values()],
                # the rollback's freed blocks, so a reader's block tables drop them as the scheduler did
                schema.STEP_SPEC_NUM_FREED_BLOCK_IDS: [len(freed.get(r, ())) for r in verified],
                schema.STEP_SPEC_FREED_BLOCK_IDS: [b for r in verified for b in freed.get(r, ())],
            }
            if runner.last_verify_s is not None:  # None: this step ran no forward pass, so it has no times
                attributes[schema.STEP_SPEC_PROPOSE_TIME] = runner.last_propose_s
                attributes[schema.STEP_SPEC_VERIFY_TIME] = runner.last_verify_s
            return attributes

        def finish_attributes(request_id: str) -> dict:
            proposed, accepted = scheduler.finished_totals.get(request_id, (0, 0))
            return {schema.SPEC_NUM_PROPOSED: proposed, schema.SPEC_NUM_ACCEPTED: accepted,
                    schema.SPEC_NUM_REJECTED: proposed - accepted}

        hooks.step_attributes.append(step_attributes)
        hooks.finish_attributes.append(finish_attributes)


def make_proposer(ctx: AssemblyContext, config: SpeculativeConfig, runner):
    """The runner's proposer, made once the runner (its device, its KV pool) exists."""
    from tinyserve.spec_decode.draft_model_proposer import DraftModelProposer
    from tinyserve.spec_decode.ngram_proposer import NgramProposer

    k = config.num_speculative_tokens
    if config.method == "ngram":
        return NgramProposer(k, config.prompt_lookup_min, config.prompt_lookup_max)
    from tinyserve.models.loader import load_model

    args, info = ctx.args, ctx.model_info
    draft, _ = load_model(config.draft_path(), info.torch_dtype, runner.device, ctx.attention_backend,
                          max_model_len=info.max_model_len)
    num_blocks = runner.kv_caches[0].shape[1]
    # The target's blocks, and room for each seat's drafts past them.
    extra = args.max_num_seqs * (-(-k // args.block_size) + 1)
    return DraftModelProposer(draft, k, num_blocks=num_blocks + extra, block_size=args.block_size,
                              dtype=info.kv_cache_dtype, device=runner.device)


def check_speculative_request(request) -> None:
    """EngineHooks.request_checks: what a speculative engine cannot serve."""
    if request.sampling_params.structured_outputs is not None:
        raise ValueError("structured outputs are not supported with speculative decoding (--speculative-config)")
