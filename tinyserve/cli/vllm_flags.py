"""vLLM's `vllm serve` flags that `tinyserve serve` takes as they are, so a vLLM launch line works unchanged.

vLLM's command line spells a flag with underscores as well as dashes (`--max_model_len`), and a field of
a JSON config flag as a dotted flag of its own (`--structured-outputs-config.backend xgrammar` is
`--structured-outputs-config '{"backend": "xgrammar"}'`); `vllm_argv` rewrites both into the one
spelling argparse knows, for every command, before anything is parsed.

Each flag is one of three things, as the request fields are (entrypoints/api/request_fields.py):

    --return-tokens-as-token-ids        implemented: logprob tokens named "token_id:N" unless a
                                        request says otherwise (its return_tokens_as_token_ids)
    --chat-template FILE_OR_TEMPLATE    implemented: the Jinja template chats are rendered with,
                                        instead of the model's (a file, or the template itself)
    --enable-per-request-metrics        implemented: each answer's `metrics` object (vLLM's
                                        PerRequestMetrics: time to first token, queue time, ...)
    --reasoning-parser NAME             implemented: chat and Responses answers split into reasoning
                                        and content (deepseek_r1, qwen3: tinyserve/reasoning/)
    --enable-prompt-embeds              implemented: completions take `prompt_embeds`, a prompt as
                                        embeddings (tinyserve/prompt_embeds/)
    --limit-mm-per-prompt JSON          implemented: the most images a prompt may carry, {"image": N}
                                        (an image-text checkpoint: tinyserve/multimodal/)
    --allowed-local-media-path FOLDER   implemented: a chat's file: image URLs are read only under it
    --allowed-media-domains HOST ...    implemented: a chat's http(s): image URLs are fetched only from
                                        these hosts (tinyserve/multimodal/media.py; none without them)
    --chat-template-content-format F    implemented: how the chat template takes a message's content:
                                        auto (found on the template), string, or openai (a list of parts)
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
import json
import logging
import re
from pathlib import Path

from tinyserve.cli.engine_flags import json_object
from tinyserve.frontend.chat_messages import CONTENT_FORMATS
from tinyserve.reasoning.parsers import REASONING_PARSERS

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


# A flag's name (what follows "--", up to "=" or the first "."), and a dotted one's fields.
_FLAG = re.compile(r"--([A-Za-z][A-Za-z0-9_-]*)((?:\.[A-Za-z0-9_-]+)*)(=.*)?", re.DOTALL)


def vllm_argv(argv: list[str]) -> list[str]:
    """argv as argparse takes it, vLLM's other spellings rewritten (vLLM's FlexibleArgumentParser does the same):

        --max_model_len 4096                            --max-model-len 4096
        --structured-outputs-config.backend xgrammar    --structured-outputs-config '{"backend": "xgrammar"}'

    A dotted flag's value is read as JSON where it is JSON (`80`, `true`), else taken as a string; the
    dotted fields of one flag, and a JSON object given to it as a whole, merge into one object. After
    `--`, nothing is rewritten.
    """
    out: list[str] = []
    dotted: dict[str, dict] = {}
    whole: dict[str, int] = {}  # a config flag given as a whole -> where its value is in `out`
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            out += argv[i:]
            break
        match = _FLAG.fullmatch(arg)
        if match is None:
            out.append(arg)
            i += 1
            continue
        name, fields, value = match.group(1).replace("_", "-"), match.group(2), match.group(3)
        if not fields:
            if name.endswith("-config") and value is not None:  # --x-config={...}: as --x-config {...}
                whole[name] = len(out) + 1
                out += [f"--{name}", value[1:]]
            else:
                if name.endswith("-config") and i + 1 < len(argv):
                    whole[name] = len(out) + 1
                out.append(f"--{name}{value or ''}")
            i += 1
            continue
        if value is not None:
            text = value[1:]
        elif i + 1 < len(argv):
            text = argv[i + 1]
            i += 1
        else:  # argparse then says the flag needs a value
            out.append(f"--{name}")
            i += 1
            continue
        i += 1
        try:
            parsed = json.loads(text)
        except ValueError:
            parsed = text
        node = dotted.setdefault(name, {})
        *parents, leaf = fields[1:].split(".")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = parsed
    for name, fields in dotted.items():
        if name in whole and whole[name] < len(out):  # merge into the object given as a whole
            try:
                given = json.loads(out[whole[name]])
            except ValueError:
                given = None
            if isinstance(given, dict):
                out[whole[name]] = json.dumps(_merged(given, fields))
                continue
        out += [f"--{name}", json.dumps(fields)]
    return out


def _merged(base: dict, update: dict) -> dict:
    merged = dict(base)
    for key, value in update.items():
        merged[key] = _merged(merged[key], value) if isinstance(value, dict) and isinstance(merged.get(key), dict) \
            else value
    return merged


def add_chat_template_flag(parser) -> None:
    parser.add_argument("--chat-template", default=None, metavar="FILE_OR_TEMPLATE",
                        help="the Jinja chat template chats are rendered with, instead of the model's: a file, or "
                             "the template itself (vLLM's)")


def load_chat_template(value: str) -> str:
    """--chat-template's template, as vLLM reads the flag: the file it names, else the value itself when it
    looks like a template (it has one of `{`, `}`, a newline); a ValueError otherwise, or when the template
    does not compile."""
    path = Path(value)
    try:
        template = path.read_text(encoding="utf-8")
    except (OSError, ValueError) as error:
        if not any(char in value for char in "{}\n"):
            raise ValueError(f"--chat-template {value!r} looks like a file path, but it cannot be read: "
                             f"{getattr(error, 'strerror', None) or error}") from None
        template = value
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template

        _compile_jinja_template(template)
    except ImportError:
        pass
    except Exception as error:  # jinja2's TemplateSyntaxError, say
        raise ValueError(f"--chat-template does not compile: {error}") from None
    return template


def add_vllm_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("vLLM's flags (see tinyserve/cli/vllm_flags.py)")
    add_chat_template_flag(group)
    group.add_argument("--enable-per-request-metrics", action="store_true",
                       help="each answer carries vLLM's per-request `metrics` object (time to first token, queue "
                            "time, ...; in a stream, on its usage chunk)")
    group.add_argument("--reasoning-parser", default=None, choices=sorted(REASONING_PARSERS),
                       help="split chat and Responses answers into reasoning (<think>...</think>) and content, "
                            "by vLLM's parser of this name (tinyserve/reasoning/)")
    group.add_argument("--enable-prompt-embeds", action="store_true",
                       help="completions take prompt_embeds: a prompt as a torch tensor of input embeddings, "
                            "torch.save'd and base64-encoded (tinyserve/prompt_embeds/)")
    group.add_argument("--limit-mm-per-prompt", type=json_object, default=None, metavar="JSON",
                       help='the most images a prompt may carry, {"image": N} (an image-text checkpoint: '
                            'tinyserve/multimodal/)')
    group.add_argument("--allowed-local-media-path", default=None, metavar="FOLDER",
                       help="a chat's file: image URLs are read only from under this folder (none without it: "
                            "tinyserve/multimodal/media.py)")
    group.add_argument("--allowed-media-domains", nargs="+", default=None, metavar="HOST",
                       help="a chat's http(s): image URLs are fetched only from these hosts (none without it)")
    group.add_argument("--chat-template-content-format", choices=CONTENT_FORMATS, default="auto",
                       help="how the chat template takes a message's content: as one string, as a list of "
                            "parts (openai), or as its syntax says (auto, the default)")
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
    """The problem with the flags (one refused, a chat template that does not load), or None; a warning line for
    each that has no effect."""
    if args.enable_chunked_prefill is False:
        return ("--no-enable-chunked-prefill is not implemented: tinyserve always chunks prefills within "
                "--max-num-batched-tokens")
    if args.chat_template is not None:
        try:
            args.chat_template = load_chat_template(args.chat_template)
        except ValueError as error:
            return str(error)
    for name, why in NO_EFFECT.items():
        if getattr(args, name) not in (None, False):
            logger.warning("--%s has no effect here: %s", name.replace("_", "-"), why)
    return None
