"""Plug speculative decoding into an engine, at its seams (`--speculative-config`).

    scheduler      SpecDecodeScheduler: drafts counted in the budget and the KV slots; rollback (scheduler.py)
    model runner   SpecDecodeModelRunner: verify, roll back, propose (model_runner.py), with its proposer:
                   NgramProposer (ngram_proposer.py) or DraftModelProposer (draft_model_proposer.py)
    engine         a request check: structured outputs are refused (one grammar state per step)
    recorder       a step hook: drafts, accepted tokens and the time proposing and verifying, on the step span;
                   a finish hook: a request's drafts proposed, accepted, rejected, on its decode span

EngineCore picks the classes while it builds the engine, as it does for --runner pooling; the
step itself does not change.
"""

import functools

from tinyserve.spec_decode.config import SpeculativeConfig, check_draft_vocabulary
from tinyserve.spec_decode.draft_model_proposer import DraftModelProposer
from tinyserve.spec_decode.model_runner import SpecDecodeModelRunner
from tinyserve.spec_decode.ngram_proposer import NgramProposer
from tinyserve.spec_decode.scheduler import SpecDecodeScheduler


def speculative_classes(args, model_info, attention_backend):
    """(scheduler class, runner class) of a speculative engine; the draft model is read here, at start-up."""
    config = SpeculativeConfig.from_dict(args.speculative_config)
    k = config.num_speculative_tokens
    if config.method == "ngram":
        def make_proposer(runner):
            return NgramProposer(k, config.prompt_lookup_min, config.prompt_lookup_max)
    else:
        draft_path = config.draft_path()
        check_draft_vocabulary(draft_path, model_info.vocab_size)

        def make_proposer(runner):
            from tinyserve.models.loader import load_model

            draft, _ = load_model(draft_path, model_info.torch_dtype, runner.device, attention_backend,
                                  max_model_len=model_info.max_model_len)
            num_blocks = runner.kv_caches[0].shape[1]
            # The target's blocks, and room for each seat's drafts past them.
            extra = args.max_num_seqs * (-(-k // args.block_size) + 1)
            return DraftModelProposer(draft, k, num_blocks=num_blocks + extra, block_size=args.block_size,
                                      dtype=model_info.kv_cache_dtype, device=runner.device)
    scheduler_class = functools.partial(SpecDecodeScheduler, num_speculative_tokens=k)
    runner_class = functools.partial(SpecDecodeModelRunner, make_proposer=make_proposer, num_speculative_tokens=k)
    return scheduler_class, runner_class


def check_speculative_request(request) -> None:
    """EngineCore.request_checks: what a speculative engine cannot serve."""
    if request.sampling_params.structured_outputs is not None:
        raise ValueError("structured outputs are not supported with speculative decoding (--speculative-config)")


def attach_spec_decode(engine) -> None:
    """The request check and the step span's attributes (lifecycle/schema.py's SPEC_DECODE_*)."""
    from tinyserve.lifecycle import schema

    engine.request_checks.append(check_speculative_request)
    scheduler, runner = engine.scheduler, engine.model_runner

    def step_attributes(scheduler_output) -> dict:
        verified = scheduler.last_verified
        return {
            schema.STEP_SPEC_REQUEST_IDS: list(verified),
            schema.STEP_SPEC_NUM_PROPOSED: [proposed for proposed, _ in verified.values()],
            schema.STEP_SPEC_NUM_ACCEPTED: [accepted for _, accepted in verified.values()],
            schema.STEP_SPEC_NUM_REJECTED: [proposed - accepted for proposed, accepted in verified.values()],
            schema.STEP_SPEC_PROPOSE_TIME: runner.last_propose_s,
            schema.STEP_SPEC_VERIFY_TIME: runner.last_verify_s,
        }

    def finished_attributes(request_id: str) -> dict:
        proposed, accepted = scheduler.finished_totals.get(request_id, (0, 0))
        return {schema.SPEC_NUM_PROPOSED: proposed, schema.SPEC_NUM_ACCEPTED: accepted,
                schema.SPEC_NUM_REJECTED: proposed - accepted}

    engine.recorder.step_hooks.append(step_attributes)
    engine.recorder.finish_hooks.append(finished_attributes)
