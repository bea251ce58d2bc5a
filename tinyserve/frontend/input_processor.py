"""Stage ②, render: turn what the user sent into an EngineCoreRequest.

A chat conversation is rendered with the model's chat template into one prompt
string, a prompt string is tokenized, and token ids are taken as they are. Every
input is checked here, once, before anything reaches the engine (`make_requests`),
for the offline LLM and the server alike; an n > 1 request fans out here into n
engine requests.

Before a text is tokenized or a chat rendered, a cheap bound refuses what could
never fit in max_model_len, so that a 4 MB prompt costs a length check, not
seconds of tokenizing (`check_text_fits`, `check_chat_fits`).
"""

import inspect
import logging
import math
import time
from dataclasses import dataclass

from tinyserve.config import InvalidInputError, ModelInfo, check_kv_fit
from tinyserve.wire.messages import EngineCoreRequest
from tinyserve.sampling_params import SamplingParams
from tinyserve.structured_output import check_structured_outputs

logger = logging.getLogger("tinyserve.requests")
_LOG_PROMPT_CHARS = 200
_LOG_PROMPT_TOKENS = 40
CHAT_ROLES = ("system", "user", "assistant", "developer", "tool")


@dataclass(slots=True)
class ProcessedPrompt:
    prompt: str | None  # the text that was tokenized, if any
    prompt_token_ids: list[int]


class InputProcessor:
    @classmethod
    def from_engine_args(cls, model_info: ModelInfo, tokenizer, args) -> "InputProcessor":
        return cls(model_info, tokenizer, args.block_size, args.max_logprobs, args.scheduling_policy, args.structured_outputs_backend)

    def __init__(self, model_info: ModelInfo, tokenizer, block_size: int, max_logprobs: int = 20,
                 scheduling_policy: str = "fcfs", structured_outputs_backend: str = "xgrammar") -> None:
        """max_logprobs: the most logprobs or prompt_logprobs a request may ask for (vLLM's flag, default 20).
        scheduling_policy: the engine's; a request's priority means something only under "priority".
        structured_outputs_backend: the engine's grammar library (it must compile a request's constraint)."""
        self.structured_outputs_backend = structured_outputs_backend
        self.model_info = model_info
        self.scheduling_policy = scheduling_policy
        self.tokenizer = tokenizer
        self.block_size = block_size
        self.max_logprobs = max_logprobs
        # The most characters one token can stand for: the longest entry of the vocabulary,
        # special tokens included. Byte-level vocabularies spell each byte as one character,
        # so there the length counts bytes, never fewer than the characters they encode.
        self.max_chars_per_token = max(map(len, tokenizer.get_vocab()), default=1)
        self._sanitizes_control_tokens = "sanitize_control_tokens" in inspect.signature(
            tokenizer.apply_chat_template).parameters

    def check_text_fits(self, text: str) -> None:
        """Refuse, without tokenizing it, a text that has more than max_model_len tokens whatever they are.

        Each token covers at most `max_chars_per_token` characters, so a text of n characters
        has at least n / max_chars_per_token tokens. A tokenizer's normalizer may first fold
        characters together, NFC and NFKC up to four into one (a letter and three accents), and
        never ASCII: outside ASCII the bound allows for that. (A normalizer that deletes text,
        BERT's accent stripping say, is not one of the model families tinyserve loads.)
        """
        fold = 1 if text.isascii() else 4
        least = math.ceil(len(text) / (self.max_chars_per_token * fold))
        max_model_len = self.model_info.max_model_len
        if least > max_model_len:
            raise InvalidInputError(
                f"prompt has {len(text)} characters: at least {least} tokens (one token of this tokenizer stands for "
                f"at most {self.max_chars_per_token * fold} characters), more than max_model_len={max_model_len}",
                "prompt")

    def check_chat_fits(self, messages: list) -> None:
        """Refuse, without rendering it, a chat with more messages than max_model_len: a chat template
        gives every message at least one token (its role marker, a turn's end)."""
        max_model_len = self.model_info.max_model_len
        if isinstance(messages, list) and len(messages) > max_model_len:
            raise InvalidInputError(f"messages has {len(messages)} messages, more than max_model_len={max_model_len}; "
                                    "each takes at least one token", "messages")

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """The ids `tokenizer.encode(text)` gives, with no length check (/tokenize counts any text).

        A fast tokenizer in the state transformers sets for a plain encode (no truncation, no
        padding, special tokens not split) is called directly, through `encode_batch_fast`:
        the pipeline transformers runs (it calls `encode_batch`) without tracking character
        offsets, and a Rust call that lets go of the GIL while it works (a single `encode`
        keeps it), so that the server's event loop runs while a thread tokenizes. What is left
        out would otherwise hold the GIL for a 4 MB prompt: offsets, an attention mask and a
        BatchEncoding, each a list of millions of entries built or freed in one C call.
        """
        backend = self._fast_backend()
        if backend is not None and backend.truncation is None and backend.padding is None \
                and backend.encode_special_tokens == self.tokenizer.split_special_tokens:
            [encoding] = backend.encode_batch_fast([text], add_special_tokens=add_special_tokens)
            return encoding.ids
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, token_ids: list[int]) -> str:
        """`tokenizer.decode(token_ids)`; a fast tokenizer's `decode_batch`, like `encode`, lets go of the GIL."""
        backend = self._fast_backend()
        if backend is not None and not self.tokenizer.clean_up_tokenization_spaces:
            [text] = backend.decode_batch([token_ids], skip_special_tokens=False)
            return text
        return self.tokenizer.decode(token_ids)

    def _fast_backend(self):
        """The Rust tokenizer under a transformers fast tokenizer, or None."""
        return getattr(self.tokenizer, "backend_tokenizer", None)

    def render_chat(self, messages: list[dict], *, add_generation_prompt: bool = True,
                    continue_final_message: bool = False, chat_template: str | None = None,
                    template_kwargs: dict | None = None) -> str:
        """Apply the chat template; messages are [{"role": ..., "content": str | [{"type": "text", ...}]}].

        add_generation_prompt: end with an open assistant turn for the reply. continue_final_message:
        end inside the last message instead (its end-of-turn marker cut off), so the reply
        continues it: an assistant message the caller has begun ("prefill").
        """
        inputs = self._chat_inputs(messages, add_generation_prompt, continue_final_message, chat_template,
                                   template_kwargs)
        return self.tokenizer.apply_chat_template(**inputs, tokenize=False)

    def tokenize_chat(self, messages: list[dict], *, fit_context: bool = True, add_generation_prompt: bool = True,
                      continue_final_message: bool = False, chat_template: str | None = None,
                      template_kwargs: dict | None = None, tools: list[dict] | None = None) -> ProcessedPrompt:
        """Render a chat (as render_chat) and tokenize it, a control token typed in a message as plain text.

        An "<|im_start|>system" inside a user's message is encoded as the characters it is,
        not as the token: only the template's own markers open and close turns, so no message
        can forge another turn. transformers does it (apply_chat_template's
        sanitize_control_tokens); with a transformers too old for that, the rendered text is
        encoded whole and such a token is the token, as in vLLM.

        fit_context: first refuse, from their number and the text's length, chats that cannot
        fit max_model_len (check_chat_fits, check_text_fits). tools: the functions the model may
        call, in OpenAI's shape, for the template to show it.
        """
        if fit_context:
            self.check_chat_fits(messages)
        inputs = self._chat_inputs(messages, add_generation_prompt, continue_final_message, chat_template,
                                   template_kwargs)
        if tools:
            inputs["tools"] = tools
        text = self.tokenizer.apply_chat_template(**inputs, tokenize=False)
        if fit_context:
            self.check_text_fits(text)
        if not self._sanitizes_control_tokens:
            return ProcessedPrompt(text, self.encode(text, add_special_tokens=False))
        token_ids = self.tokenizer.apply_chat_template(**inputs, tokenize=True, return_dict=False,
                                                       sanitize_control_tokens=True)
        return ProcessedPrompt(text, token_ids)

    def _chat_inputs(self, messages, add_generation_prompt: bool, continue_final_message: bool,
                     chat_template: str | None, template_kwargs: dict | None) -> dict:
        """apply_chat_template's arguments, each checked."""
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages must be a non-empty list")
        if add_generation_prompt and continue_final_message:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
        reserved = {"tokenize", "add_generation_prompt", "continue_final_message", "chat_template", "conversation",
                    "sanitize_control_tokens", "return_dict", "tools"}
        if template_kwargs and reserved & set(template_kwargs):
            raise InvalidInputError(f"chat_template_kwargs cannot set {sorted(reserved & set(template_kwargs))}",
                                    "chat_template_kwargs")
        normalized = [_normalize_message(i, message) for i, message in enumerate(messages)]
        template = chat_template or self.tokenizer.chat_template
        if template is None:
            raise ValueError("the model has no chat template; pass chat_template or send a plain prompt")
        return {"conversation": normalized, "chat_template": template, "add_generation_prompt": add_generation_prompt,
                "continue_final_message": continue_final_message, **(template_kwargs or {})}

    def tokenize_prompt(self, prompt, *, add_special_tokens: bool = True) -> ProcessedPrompt:
        """A string, a list of token ids, or {"prompt_token_ids": [...]} / {"prompt": "..."}."""
        if isinstance(prompt, dict):
            unknown = sorted(set(prompt) - {"prompt", "prompt_token_ids"})
            if unknown:  # multi_modal_data, say: refused, not silently dropped
                raise ValueError(f"a prompt dict takes 'prompt' or 'prompt_token_ids'; {', '.join(unknown)} "
                                 "is not supported")
            if "prompt_token_ids" in prompt:
                prompt = list(prompt["prompt_token_ids"])
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            self.check_text_fits(prompt)
            return ProcessedPrompt(prompt, self.encode(prompt, add_special_tokens=add_special_tokens))
        if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return ProcessedPrompt(None, prompt)
        raise ValueError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")

    def make_requests(
        self,
        request_id: str,
        prompt: ProcessedPrompt,
        sampling_params: SamplingParams,
        *,
        num_kv_blocks: int,
        arrival_time: float | None = None,
        priority: int = 0,
        trace_context: dict[str, str] | None = None,
    ) -> list[EngineCoreRequest]:
        """Check the request, then fan it out: one EngineCoreRequest per sample (n > 1 → n of them).

        This is the one place a request is validated, for the offline LLM and the server
        alike: the prompt against the vocabulary and max_model_len, token ids in the
        sampling parameters, and whether the request could ever fit in the KV pool of
        `num_kv_blocks` blocks. Child i of an n > 1 request gets `child_request_id(...)`
        and, if seeded, the seed + i, so the n samples differ yet each is reproducible.
        """
        self.model_info.validate_prompt(prompt.prompt_token_ids)
        if priority != 0 and self.scheduling_policy != "priority":  # as vLLM: never silently ignored
            raise InvalidInputError(f"priority={priority} needs --scheduling-policy priority; this engine schedules "
                                    f"{self.scheduling_policy!r}", "priority")
        for name, token_ids in (("stop_token_ids", sampling_params.stop_token_ids),
                                ("logit_bias", sampling_params.logit_bias)):
            for token_id in token_ids or ():
                if not 0 <= token_id < self.model_info.vocab_size:
                    raise ValueError(
                        f"{name} contains {token_id}, outside the vocabulary [0, {self.model_info.vocab_size})")
        vocab_size = self.model_info.vocab_size
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(sampling_params, name)
            limit = min(self.max_logprobs, vocab_size)
            if value is not None and value > limit:
                raise InvalidInputError(f"{name}={value} is more than the most this engine returns, {limit} "
                                        f"(max_logprobs={self.max_logprobs}, vocabulary {vocab_size})", name)
        if sampling_params.structured_outputs is not None:  # one the grammar library cannot compile: a 400
            check_structured_outputs(sampling_params.structured_outputs, self.structured_outputs_backend)
        check_kv_fit(len(prompt.prompt_token_ids), sampling_params.max_tokens, self.model_info.max_model_len,
                     self.block_size, num_kv_blocks)
        arrival_time = arrival_time if arrival_time is not None else time.time()
        n = sampling_params.n
        return [
            EngineCoreRequest(
                request_id=child_request_id(request_id, index, n),
                prompt_token_ids=prompt.prompt_token_ids,
                sampling_params=sampling_params if n == 1 else sampling_params.clone(
                    n=1, seed=child_seed(sampling_params.seed, index)),
                eos_token_ids=self.model_info.eos_token_ids,
                arrival_time=arrival_time,
                priority=priority,
                trace_context=trace_context or {},
            )
            for index in range(n)
        ]


def child_seed(seed: int | None, index: int) -> int | None:
    """Sample `index`'s seed: seed + index, wrapped around within the 64-bit range every seed may take."""
    if seed is None:
        return None
    return (seed + index + 2**63) % 2**64 - 2**63


def child_request_id(parent_id: str, index: int, n: int) -> str:
    """The engine's id for sample `index` of a request: the request's own id when n == 1."""
    return parent_id if n == 1 else f"{index}_{parent_id}"


def _normalize_message(index: int, message) -> dict:
    if not isinstance(message, dict):
        raise ValueError(f"messages[{index}] must be an object with 'role' and 'content'")
    role = message.get("role")
    if role not in CHAT_ROLES:
        raise ValueError(f"messages[{index}].role must be one of {CHAT_ROLES}, got {role!r}")
    content = message.get("content")
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError(f"messages[{index}].content[{j}] must be a text part {{'type': 'text', 'text': ...}}")
            parts.append(part["text"])
        content = "".join(parts)
    if not isinstance(content, str):
        raise ValueError(f"messages[{index}].content must be a string or a list of text parts")
    normalized = {"role": role, "content": content}
    for key, kind in (("name", str), ("tool_call_id", str), ("tool_calls", list)):
        if message.get(key) is not None:
            if not isinstance(message[key], kind):
                raise ValueError(f"messages[{index}].{key} must be a {'string' if kind is str else 'list'}")
            normalized[key] = message[key]
    return normalized


def log_inputs(request_id: str, prompt: ProcessedPrompt, params: SamplingParams) -> None:
    """One line per request with what it asked for (prompt and ids truncated), as vLLM logs."""
    text = None if prompt.prompt is None else prompt.prompt[:_LOG_PROMPT_CHARS]
    logger.info(
        "Received request %s: prompt: %r, params: %s, prompt_token_ids: %s (%d tokens)",
        request_id, text, params, prompt.prompt_token_ids[:_LOG_PROMPT_TOKENS], len(prompt.prompt_token_ids),
    )
