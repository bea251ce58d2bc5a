"""vLLM's `vllm serve` flags that `tinyserve serve` takes as they are, so a vLLM launch line works unchanged.

Each flag is one of three things, as the request fields are (entrypoints/api/request_fields.py):

    --return-tokens-as-token-ids        implemented: logprob tokens named "token_id:N" unless a
                                        request says otherwise (its return_tokens_as_token_ids)
    --enable-chunked-prefill            what tinyserve always does (chunked prefill, prefix
    --enable-tokenizer-info-endpoint    caching's prompt_tokens_details, /tokenizer_info are
    --enable-prompt-tokens-details      always on): accepted
    --disable-frontend-multiprocessing  no effect on any output: the API and the engine always run
    --show-hidden-metrics-for-version   in their own processes; no metric is hidden. Accepted,
                                        with one warning line saying so
    --no-enable-chunked-prefill         would change the schedule, and is not implemented: refused

Nothing here changes an output without being implemented, and nothing is silently ignored.
"""

import argparse
import logging

logger = logging.getLogger("tinyserve.cli")

# flag (as argparse names its dest) -> why it changes nothing here
ALWAYS_ON = {
    "enable_chunked_prefill": "chunked prefill is always on",
    "enable_tokenizer_info_endpoint": "/tokenizer_info is always served",
    "enable_prompt_tokens_details": "usage always carries prompt_tokens_details (cached_tokens)",
}
NO_EFFECT = {
    "disable_frontend_multiprocessing": "the API and the engines always run in processes of their own",
    "show_hidden_metrics_for_version": "no metric is hidden",
}


def add_vllm_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("vLLM's flags (see tinyserve/cli/vllm_flags.py)")
    group.add_argument("--return-tokens-as-token-ids", action="store_true",
                       help="name logprob tokens 'token_id:N' (a request's return_tokens_as_token_ids overrides)")
    group.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=None,
                       help="always on here; --no-enable-chunked-prefill is refused")
    group.add_argument("--enable-tokenizer-info-endpoint", action="store_true",
                       help="vLLM serves /tokenizer_info only with this flag; tinyserve always serves it")
    group.add_argument("--enable-prompt-tokens-details", action="store_true",
                       help="vLLM reports usage.prompt_tokens_details only with this flag; tinyserve always does")
    group.add_argument("--disable-frontend-multiprocessing", action="store_true", help="no effect here")
    group.add_argument("--show-hidden-metrics-for-version", metavar="VERSION", default=None, help="no effect here")


def check_vllm_flags(args: argparse.Namespace) -> str | None:
    """The problem with the flags (a refused one), or None; a warning line for each that has no effect."""
    if args.enable_chunked_prefill is False:
        return ("--no-enable-chunked-prefill is not implemented: tinyserve always chunks prefills within "
                "--max-num-batched-tokens")
    for name, why in NO_EFFECT.items():
        if getattr(args, name) not in (None, False):
            logger.warning("--%s has no effect here: %s", name.replace("_", "-"), why)
    return None
