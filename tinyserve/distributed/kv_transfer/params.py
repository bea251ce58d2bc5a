"""kv_transfer_params, as a request carries them (vLLM's fields), checked against the engine's KV connector.

    to a prefill engine:  {"do_remote_decode": true}
    to a decode engine:   what the prefill's response returned: {"do_remote_prefill": true, "remote_host",
                          "remote_port", "remote_request_id", "remote_block_ids", "remote_num_tokens",
                          "remote_prompt_hash", "remote_signature", ...}

The front end checks them (input_processor.py), and an engine process again, as they arrive on its socket.
A decode engine takes only parameters a prefill engine sharing its secret signed, for this very prompt
(trust.py): checked here, before anything connects to the host and port they name.
"""

from tinyserve.distributed.kv_transfer.config import KVTransferConfig
from tinyserve.distributed.kv_transfer.metadata import prompt_hash
from tinyserve.distributed.kv_transfer.trust import SECRET_ENV, signature_matches
from tinyserve.errors import InvalidInputError
from tinyserve.utils import cdiv

REMOTE_FIELDS = {"remote_host": str, "remote_port": int, "remote_request_id": str, "remote_block_ids": list,
                 "remote_num_tokens": int}


def check_kv_transfer_params(config: KVTransferConfig, block_size: int, prompt_token_ids: list[int],
                             sampling_params) -> None:
    """An InvalidInputError naming kv_transfer_params refuses the request (a 400)."""
    params = (sampling_params.extra_args or {}).get("kv_transfer_params")
    if params is None:
        return
    if not isinstance(params, dict):
        raise _refusal(f"kv_transfer_params must be an object, got {params!r}")
    if params.get("do_remote_decode") and not config.is_kv_producer:
        raise _refusal(f"kv_transfer_params.do_remote_decode needs a prefill engine (kv_role kv_producer or "
                       f"kv_both); this one is {config.kv_role}")
    if params.get("do_remote_decode") and config.shared_secret is None:
        raise _refusal(f"kv_transfer_params.do_remote_decode: this engine hands K/V only to decode engines "
                       f"sharing its secret, and it has none: set {SECRET_ENV} on the prefill and decode servers")
    if not params.get("do_remote_prefill"):
        return
    if not config.is_kv_consumer:
        raise _refusal(f"kv_transfer_params.do_remote_prefill needs a decode engine (kv_role kv_consumer or "
                       f"kv_both); this one is {config.kv_role}")
    if config.shared_secret is None:
        raise _refusal(f"kv_transfer_params.do_remote_prefill: this engine pulls K/V only from prefill engines "
                       f"sharing its secret, and it has none: set {SECRET_ENV} on the prefill and decode servers")
    for name, kind in REMOTE_FIELDS.items():
        if not isinstance(params.get(name), kind) or isinstance(params.get(name), bool):
            raise _refusal(f"kv_transfer_params.{name} must be a {kind.__name__}, got {params.get(name)!r}")
    num_tokens = len(prompt_token_ids)
    if params["remote_num_tokens"] != num_tokens:
        raise _refusal(f"kv_transfer_params are for a prompt of {params['remote_num_tokens']} tokens; this "
                       f"request's has {num_tokens}")
    if len(params["remote_block_ids"]) != cdiv(num_tokens, block_size):
        raise _refusal(f"kv_transfer_params.remote_block_ids has {len(params['remote_block_ids'])} blocks; a prompt "
                       f"of {num_tokens} tokens fills {cdiv(num_tokens, block_size)} of {block_size} tokens "
                       f"(--block-size must be the prefill engine's)")
    if not signature_matches(config.shared_secret, params):
        raise _refusal(f"kv_transfer_params.remote_signature does not match: these parameters were not handed out "
                       f"by a prefill engine sharing this engine's secret ({SECRET_ENV}), or were changed since; "
                       f"K/V are pulled from no other")
    if params.get("remote_prompt_hash") != prompt_hash(prompt_token_ids):
        raise _refusal("kv_transfer_params.remote_prompt_hash: the prefill engine computed another prompt's K/V")


def _refusal(message: str) -> InvalidInputError:
    return InvalidInputError(message, "kv_transfer_params")
