"""Stage ②, render: a chat rendered with the model's chat template, a prompt tokenized.

The Renderer holds the tokenizer and the chat template. A conversation becomes one
prompt string through the template (`render_chat`), and token ids (`tokenize_chat`); a
plain prompt is tokenized as it is (`tokenize_prompt`). Before a text is tokenized or a
chat rendered, a cheap bound refuses what could never fit in max_model_len, so that a
4 MB prompt costs a length check, not seconds of tokenizing (`check_text_fits`,
`check_chat_fits`). `encode` and `decode` take the tokenizer's Rust paths that let go of
the GIL, so the server's render threads (render_threads.py) run beside its event loop.

The input processor (input_processor.py) is a Renderer that also checks the sampling
parameters and makes the engine's requests.
"""

import inspect
import math
from dataclasses import dataclass

from tinyserve.config import ModelInfo
from tinyserve.errors import InvalidInputError
from tinyserve.frontend.chat_messages import CONTENT_FORMATS, chat_content_format, normalize_message
from tinyserve.prompt_embeds.tensors import check_prompt_embeds, decode_prompt_embeds
from tinyserve.wire.messages import MultiModalFeature, PromptEmbeds



@dataclass(slots=True)
class ProcessedPrompt:
    prompt: str | None  # the text that was tokenized, if any
    prompt_token_ids: list[int]  # given as embeddings: one placeholder (0) per row
    prompt_embeds: PromptEmbeds | None = None  # a prompt given as embeddings (tinyserve/prompt_embeds/)
    mm_features: list[MultiModalFeature] | None = None  # its images (tinyserve/multimodal/), in prompt order

    @property
    def known_token_ids(self) -> list[int]:
        """The ids the prompt's text is: none for a prompt given as embeddings (its ids are placeholders), so
        the output's text is read on its own, as vLLM reads it."""
        return self.prompt_token_ids if self.prompt_embeds is None else []


@dataclass(frozen=True, slots=True)
class Truncation:
    """vLLM's truncate_prompt_tokens: a prompt longer than `keep` tokens keeps `keep` of them, from its
    end (side "left": the start is cut off, vLLM's default when generating) or from its start (side
    "right", its default for embeddings). The request's -1 ("as much as the context takes") is resolved
    to a number before it gets here."""

    keep: int
    side: str = "left"

    def apply(self, token_ids: list[int]) -> list[int]:
        if len(token_ids) <= self.keep:
            return token_ids
        if self.keep == 0:
            return []
        return token_ids[-self.keep:] if self.side == "left" else token_ids[:self.keep]

    def apply_to(self, prompt: ProcessedPrompt) -> ProcessedPrompt:
        """The prompt truncated: its text left out when any token was cut (what is left of it is its ids)."""
        kept = self.apply(prompt.prompt_token_ids)
        return prompt if kept is prompt.prompt_token_ids else ProcessedPrompt(None, kept)


class Renderer:
    def __init__(self, model_info: ModelInfo, tokenizer, *, enable_prompt_embeds: bool = False,
                 limit_images_per_prompt: int | None = None, media=None, content_format: str = "auto") -> None:
        """enable_prompt_embeds: the engine's (--enable-prompt-embeds); without it a prompt_embeds is a 400.
        limit_images_per_prompt: --limit-mm-per-prompt's "image" (None: no limit). media: where a chat's
        image URLs may be read from (multimodal/media.py's MediaConnector; None: data: URLs only).
        content_format: how the template takes a message's content (--chat-template-content-format)."""
        if content_format not in CONTENT_FORMATS:
            raise ValueError(f"chat_template_content_format must be one of {CONTENT_FORMATS}, got {content_format!r}")
        self.content_format = content_format
        self.model_info = model_info
        self.tokenizer = tokenizer
        self.enable_prompt_embeds = enable_prompt_embeds
        self.limit_images_per_prompt = limit_images_per_prompt
        self.media = media
        self._processor_template = None  # an image-text checkpoint keeps its chat template with its processor
        if model_info.image_token_id is not None:
            from tinyserve.multimodal.processor import processor_chat_template

            self._processor_template = processor_chat_template(model_info.path)
        # The most characters one token can stand for: the longest entry of the vocabulary,
        # special tokens included. Byte-level vocabularies spell each byte as one character,
        # so there the length counts bytes, never fewer than the characters they encode.
        self.max_chars_per_token = max(map(len, tokenizer.get_vocab()), default=1)
        self._sanitizes_control_tokens = "sanitize_control_tokens" in inspect.signature(
            tokenizer.apply_chat_template).parameters

    @property
    def chat_template(self) -> str | None:
        """The tokenizer's (which --chat-template replaces), else the processor's."""
        return self.tokenizer.chat_template or self._processor_template

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
        inputs, _ = self._chat_inputs(messages, add_generation_prompt, continue_final_message, chat_template,
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
        inputs, images = self._chat_inputs(messages, add_generation_prompt, continue_final_message, chat_template,
                                           template_kwargs)
        if tools:
            inputs["tools"] = tools
        text = self.tokenizer.apply_chat_template(**inputs, tokenize=False)
        if fit_context:
            self.check_text_fits(text)
        if images:
            from tinyserve.multimodal.chat import process_chat

            token_ids, features = process_chat(self.model_info, text, images)
            return ProcessedPrompt(text, token_ids, mm_features=features)
        if not self._sanitizes_control_tokens:
            return ProcessedPrompt(text, self.encode(text, add_special_tokens=False))
        token_ids = self.tokenizer.apply_chat_template(**inputs, tokenize=True, return_dict=False,
                                                       sanitize_control_tokens=True)
        return ProcessedPrompt(text, token_ids)

    def _chat_inputs(self, messages, add_generation_prompt: bool, continue_final_message: bool,
                     chat_template: str | None, template_kwargs: dict | None) -> tuple[dict, list]:
        """apply_chat_template's arguments, each checked, and the chat's images in order (multimodal/chat.py:
        each image part read, and shown to the template as its content format takes it)."""
        if not isinstance(messages, list) or not messages:
            raise InvalidInputError("messages must be a non-empty list")
        if add_generation_prompt and continue_final_message:
            raise InvalidInputError("continue_final_message and add_generation_prompt cannot both be true")
        reserved = {"tokenize", "add_generation_prompt", "continue_final_message", "chat_template", "conversation",
                    "sanitize_control_tokens", "return_dict", "tools"}
        if template_kwargs and reserved & set(template_kwargs):
            raise InvalidInputError(f"chat_template_kwargs cannot set {sorted(reserved & set(template_kwargs))}",
                                    "chat_template_kwargs")
        normalized = [normalize_message(i, message) for i, message in enumerate(messages)]
        template = chat_template or self.chat_template
        if template is None:
            raise InvalidInputError("the model has no chat template; pass chat_template or send a plain prompt")
        images = []
        shown = chat_content_format(template) if self.content_format == "auto" else self.content_format
        if any(isinstance(message["content"], list) for message in normalized):
            from tinyserve.multimodal.chat import chat_images

            normalized, images = chat_images(normalized, shown, self.model_info, self.limit_images_per_prompt,
                                             self.media)
        if shown == "openai":  # such a template reads every message's content as parts
            normalized = [{**m, "content": [{"type": "text", "text": m["content"]}]} if isinstance(m["content"], str)
                          else m for m in normalized]
        return {"conversation": normalized, "chat_template": template, "add_generation_prompt": add_generation_prompt,
                "continue_final_message": continue_final_message, **(template_kwargs or {})}, images

    def tokenize_prompt(self, prompt, *, add_special_tokens: bool = True,
                        truncation: Truncation | None = None) -> ProcessedPrompt:
        """A string, a list of token ids, or {"prompt_token_ids": [...]} / {"prompt": "..."}.

        truncation: keep that many tokens of a longer prompt (vLLM's truncate_prompt_tokens); the
        prompt's text is then None (what is left of it is its tokens). A text too long to fit the
        context is first cut, on the side truncation keeps, to what max_model_len tokens could
        cover, as vLLM cuts it, so that a huge prompt is not tokenized whole.
        """
        if isinstance(prompt, dict):
            unknown = sorted(set(prompt) - {"prompt", "prompt_token_ids", "prompt_embeds", "multi_modal_data"})
            if unknown:  # refused, not silently dropped
                raise InvalidInputError(f"a prompt dict takes 'prompt', 'prompt_token_ids', 'prompt_embeds' or "
                                        f"'multi_modal_data'; {', '.join(unknown)} is not supported")
            if "multi_modal_data" in prompt:
                return self.images_prompt(prompt, add_special_tokens, truncation)
            if "prompt_embeds" in prompt:
                return self.embeds_prompt(prompt["prompt_embeds"], truncation)
            if "prompt_token_ids" in prompt:
                prompt = list(prompt["prompt_token_ids"])
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise InvalidInputError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidInputError("prompt must not be empty")
            if truncation is None:
                self.check_text_fits(prompt)
                return ProcessedPrompt(prompt, self.encode(prompt, add_special_tokens=add_special_tokens))
            most = self.model_info.max_model_len * self.max_chars_per_token * 4  # 4: what a normalizer may fold
            text = prompt if len(prompt) <= most else prompt[-most:] if truncation.side == "left" else prompt[:most]
            token_ids = self.encode(text, add_special_tokens=add_special_tokens)
            kept = truncation.apply(token_ids)
            return ProcessedPrompt(prompt if kept is token_ids and text is prompt else None, kept)
        if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return ProcessedPrompt(None, prompt if truncation is None else truncation.apply(prompt))
        raise InvalidInputError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")

    def images_prompt(self, prompt: dict, add_special_tokens: bool = True,
                      truncation: Truncation | None = None) -> ProcessedPrompt:
        """A prompt with images: its text or token ids through the checkpoint's processor, each image's
        placeholders expanded and its pixels beside them (tinyserve/multimodal/processor.py's images_prompt)."""
        from tinyserve.multimodal.processor import images_prompt

        text, token_ids, features = images_prompt(self, prompt, add_special_tokens, truncation)
        return ProcessedPrompt(text, token_ids, mm_features=features or None)

    def check_embeds_enabled(self) -> None:
        if not self.enable_prompt_embeds:
            raise InvalidInputError("prompt_embeds needs an engine started with --enable-prompt-embeds "
                                    "(offline: LLM(..., enable_prompt_embeds=True))", "prompt_embeds")

    def embeds_prompt(self, prompt_embeds, truncation: Truncation | None = None) -> ProcessedPrompt:
        """A prompt given as embeddings: a tensor (offline), or torch.save's bytes in base64 (the API's), checked
        against the model (tinyserve/prompt_embeds/tensors.py); its token ids are one placeholder per row."""
        self.check_embeds_enabled()
        if truncation is not None:  # vLLM truncates token ids only; here that is said, not left unsaid
            raise InvalidInputError("truncate_prompt_tokens applies to token ids, not to prompt_embeds",
                                    "truncate_prompt_tokens")
        load = decode_prompt_embeds if isinstance(prompt_embeds, (str, bytes)) else check_prompt_embeds
        embeds = load(prompt_embeds, self.model_info)
        return ProcessedPrompt(None, [0] * embeds.rows, embeds)
