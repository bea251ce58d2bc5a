"""The request fields clients send that tinyserve does not implement, and what it does with each (stage ①).

A field a client sends is one of three things:

- implemented: a field of the body's pydantic model (openai_protocol.py, anthropic_serving.py,
  responses_protocol.py), changing the output as the API documents;
- refused: listed in REFUSED below. Sent with a value that asks for something, it is a 400
  naming the field; sent with a value that asks for nothing (null, an empty list, the
  API's default) it is accepted, since clients send defaults they did not choose;
- without effect on the output: listed in NO_EFFECT, with why (billing, storage, routing,
  caching hints of a hosted API). Accepted (some, `user` say, with their type checked by the
  model) and not used.

Anything else is ignored, as OpenAI clients send fields a server may not know. The
tables are data on purpose: implementing a field means removing it from here and
adding it to the body's model; tests/test_request_fields.py walks the field lists of
the openai and anthropic clients and of vLLM's protocol and checks each is one of the
three.
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError
from pydantic_core import InitErrorDetails, PydanticCustomError


@dataclass(frozen=True, slots=True)
class Refused:
    reason: str
    nothing: tuple = (None,)  # values that ask for nothing, and so are accepted
    # Or a test on the value and the whole body, for a field whose harmless values depend on another.
    asks_nothing: Callable[[Any, dict], bool] | None = None

    def refuses(self, value, body: dict) -> bool:
        if self.asks_nothing is not None:
            return not self.asks_nothing(value, body)
        return not any(value == harmless and type(value) is type(harmless) for harmless in self.nothing)


def _tools_unused(value, body: dict) -> bool:
    return value is None or value == [] or body.get("tool_choice") == "none"


# What `include` may name without it changing the answer: output of items this server never makes
# (hosted tools' calls, reasoning items) and of input images, which it does not take.
_NEVER_MADE = ("file_search_call.results", "web_search_call.results", "web_search_call.action.sources",
               "message.input_image.image_url", "computer_call_output.output.image_url",
               "code_interpreter_call.outputs", "reasoning.encrypted_content")


# What Responses' `include` may name: the output's logprobs (implemented), and the items never made.
INCLUDABLE = ("message.output_text.logprobs", *_NEVER_MADE)


_STRUCTURED = {
    **{name: Refused(f"vLLM's older spelling: give structured_outputs {{\"{name.removeprefix('guided_')}\": ...}}")
       for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar")},
    "structural_tag": Refused("no structural tags; use structured_outputs"),
    "guided_decoding_backend": Refused("the grammar library is the server's --structured-outputs-backend"),
    "guided_whitespace_pattern": Refused("JSON is constrained to compact whitespace"),
}
_OLD_FUNCTIONS = "the API's older spelling of tools: give tools and tool_choice"
# vLLM's extra fields that both of its OpenAI endpoints take, and tinyserve does not implement.
_VLLM_EXTRAS = {
    **_STRUCTURED,
    "use_beam_search": Refused("no beam search", (None, False)),
    "length_penalty": Refused("it applies to beam search, which there is none of", (None, 1.0, 1)),
    "spaces_between_special_tokens": Refused("special tokens are detokenized without spaces added",
                                             (None, True)),
    "logits_processors": Refused("no custom logits processors"),
    "cache_salt": Refused("the prefix cache is shared by all requests: it has no salt to isolate them"),
    "vllm_xargs": Refused("no extension reads extra arguments"),
    "mm_processor_kwargs": Refused("an image-text checkpoint's processor runs with the settings it was saved with"),
}
_OPENAI_NO_EFFECT = {
    "metadata": "tags for a hosted API's dashboard",
    "store": "a hosted API keeps completions for later retrieval; this server keeps none",
    "service_tier": "a hosted API's capacity tier",
    "safety_identifier": "a hosted API's abuse monitoring",
    "prompt_cache_key": "a routing hint for a hosted API's prompt cache; the prefix cache here needs none",
    "prompt_cache_retention": "a hosted API's prompt-cache lifetime",
    "prompt_cache_options": "a hosted API's prompt-cache options",
    "request_id": "vLLM's name for the request in its logs; responses carry the server's own id",
    "user": "an end user's id, for a hosted API's abuse monitoring",
}

REFUSED: dict[str, dict[str, Refused]] = {
    "chat": {
        **_VLLM_EXTRAS,
        "functions": Refused(_OLD_FUNCTIONS, asks_nothing=_tools_unused),
        "function_call": Refused(_OLD_FUNCTIONS, (None, "none")),
        "best_of": Refused("as in vLLM V1; use n", (None, 1)),
        "audio": Refused("no audio output"),
        "modalities": Refused("text is the only output", (None, ["text"])),
        "prediction": Refused("no predicted outputs"),
        "web_search_options": Refused("no web search"),
        "moderation": Refused("no moderation"),
        "verbosity": Refused("the model has no verbosity to set"),
        "add_special_tokens": Refused("the chat template adds the special tokens", (None, False)),
        "documents": Refused("no documents for a template's retrieval section"),
        "chat_template": Refused("a chat template sent with the request is not accepted; the model's is used"),
        "prompt_embeds": Refused("a chat is messages; /v1/completions takes prompt_embeds", (None, [])),
    },
    "completions": {
        **_VLLM_EXTRAS,
        "best_of": Refused("as in vLLM V1; use n", (None, 1)),
        "suffix": Refused("no fill-in-the-middle", (None, "")),
        "add_special_tokens": Refused("a prompt is always tokenized with its special tokens", (None, True)),
    },
    "messages": {
        "thinking": Refused("no extended thinking", (None, {"type": "disabled"})),
        "container": Refused("no code-execution containers"),
        "mcp_servers": Refused("no MCP servers", (None, [])),
        "context_management": Refused("no context management: the conversation is rendered as sent, its tool "
                                      "results and thinking kept"),
        "compaction": Refused("no compaction: the reply is never a summary of the conversation"),
        "thread": Refused("no server-held threads: send the whole conversation in messages"),
        # vLLM's extra; disaggregated prefill is served on /v1/completions and /v1/chat/completions
        "kv_transfer_params": Refused("disaggregated prefill is served on /v1/completions and /v1/chat/completions"),
    },
    "responses": {
        "background": Refused("no background responses", (None, False)),
        "conversation": Refused("conversations are not stored; use previous_response_id"),
        "prompt": Refused("no stored prompt templates"),
        "context_management": Refused("no context management"),
        "image": Refused("no image generation"),
        "moderation": Refused("no moderation"),
        "stream_options": Refused("no stream options for Responses"),
        "background_options": Refused("no background responses"),
        "access_programs": Refused("no access programs"),
        # vLLM's extras of its ResponsesRequest that tinyserve does not implement
        **{name: _VLLM_EXTRAS[name] for name in ("mm_processor_kwargs", "cache_salt", "vllm_xargs")},
        "previous_input_messages": Refused("gpt-oss's harmony messages; use previous_response_id, or give the "
                                           "conversation as input items"),
        "previous_response": Refused("gpt-oss's stateless continuation; use previous_response_id, or give the "
                                     "conversation as input items"),
    },
}
# vLLM's extras of its embedding and pooling requests that tinyserve does not implement.
_POOLING_REFUSED = {
    "activation": Refused("vLLM's older name: give use_activation"),
    **{name: _VLLM_EXTRAS[name] for name in ("mm_processor_kwargs", "cache_salt", "vllm_xargs")},
}
REFUSED["embeddings"] = _POOLING_REFUSED
REFUSED["pooling"] = _POOLING_REFUSED

# request_id is implemented by chat and completions: their answer's id is "chatcmpl-" or "cmpl-" and it, as vLLM's.
_CHAT_AND_COMPLETIONS_NO_EFFECT = {name: why for name, why in _OPENAI_NO_EFFECT.items() if name != "request_id"}

NO_EFFECT: dict[str, dict[str, str]] = {
    "chat": _CHAT_AND_COMPLETIONS_NO_EFFECT,
    "completions": _CHAT_AND_COMPLETIONS_NO_EFFECT,
    "messages": {
        "metadata": "the caller's user id, for a hosted API's abuse monitoring",
        "service_tier": "a hosted API's capacity tier",
        "cache_control": "a hosted API's prompt-cache breakpoint; the prefix cache here needs none",
        "inference_geo": "a hosted API's region",
        "speed": "a hosted API's speed mode; the output is the same",
        "diagnostics": "a hosted API's prompt-cache diagnostics",
        "user_profile_id": "a hosted API's attribution",
        "workspace_id": "a hosted API's workspace",
        "billing_policy": "which of a hosted API's organizations is billed",
        "fallback_credit_token": "a hosted API's billing of a retry's prompt cache",
        "fallbacks": "a hosted API's models tried when the one asked for declines; the model here never declines",
    },
    "embeddings": _CHAT_AND_COMPLETIONS_NO_EFFECT,
    "pooling": _CHAT_AND_COMPLETIONS_NO_EFFECT,
    "responses": {
        **{name: why for name, why in _OPENAI_NO_EFFECT.items() if name != "store"},  # store: implemented
        "truncation": "\"auto\" drops the start of a conversation that does not fit; one that fits is the same, "
                      "and one that does not is a 400 naming truncation (the context is never truncated)",
    },
}


def check_refused(kind: str, body) -> None:
    """Raise a ValidationError naming each refused field of `body` (a request's raw JSON) that asks for something."""
    if not isinstance(body, dict):
        return
    errors = [
        InitErrorDetails(type=PydanticCustomError("not_supported", "is not supported by this server: {reason}",
                                                  {"reason": rule.reason}), loc=(name,), input=body[name])
        for name, rule in REFUSED[kind].items() if name in body and rule.refuses(body[name], body)
    ]
    if errors:
        raise ValidationError.from_exception_data(kind, errors)
