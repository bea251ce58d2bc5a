"""Request bodies of the OpenAI endpoints, validated with pydantic.

Field names and ranges follow the OpenAI API, plus vLLM's extra sampling fields
(top_k, min_p, repetition_penalty, ignore_eos, min_tokens, stop_token_ids,
allowed_token_ids, bad_words, prompt_logprobs, continue_final_message,
chat_template_kwargs, priority, request_id, kv_transfer_params). Unknown
fields are ignored, as OpenAI clients send fields a server may not use (and named in a
warning and the X-Ignored-Fields header, as strict_body.py says); but a known
field that would change what is generated and that tinyserve does not implement
(best_of, suffix, ...: the tables in request_fields.py) is refused with a 400
naming it, rather than quietly giving other output than was asked for. The fields
that constrain the output (response_format, structured_outputs, tools) are
structured_protocol.py's; strict types and valid Unicode are strict_body.py's. The module
is over 300 lines because every OpenAI body, with all of vLLM's extra fields, is here in one
place, where a reader (and tests/test_request_fields.py) finds the whole surface.
"""

from typing import Annotated, Any, ClassVar, Literal

from pydantic import ConfigDict, Field, ValidationInfo, field_validator, model_validator

from tinyserve.entrypoints.api.guards.strict_body import StrictBody, Text
from tinyserve.entrypoints.api.request_ids import MAX_REQUEST_ID_CHARS
from tinyserve.entrypoints.api.tools.structured_protocol import (
    AssistantToolCall,
    ConstrainedFields,
    NamedToolChoice,
    Tool,
    ToolChoice,
    check_tool_choice,
)
from tinyserve.errors import InvalidInputError
from tinyserve.sampling_params import MAX_LOGPROB_TOKEN_IDS, MAX_NUM_BAD_WORDS, SamplingParams

# Seeds and priorities cross to the engine as 64-bit integers. The bound is the largest float below 2**63
# rather than 2**63 itself: a JSON Schema validator comparing numbers as floats reads 2**63 + 100 as 2**63,
# so /openapi.json states a bound every validator holds exactly, and the server keeps the same one.
INT64 = 2**63 - 1024
# A seed is any int64, as vLLM takes it (clients send 2**63 - 1): there the document states the exact bounds,
# which a float-comparing validator reads as +-2**63.
SEED = {"ge": -(2**63), "le": 2**63 - 1}


def exact_seed_bounds(schemas: dict, variants) -> None:
    """FastAPI writes SEED's bounds into /openapi.json as floats (+-2**63), which would let 2**63 through: they
    are written back as the integers they are. variants: a property's alternatives (openapi._variants)."""
    for name in ("ChatCompletionRequest", "CompletionRequest", "ResponsesRequest"):
        for variant in variants(schemas.get(name, {}).get("properties", {}).get("seed") or {}):
            if variant.get("type") == "integer":
                variant["minimum"], variant["maximum"] = -(2**63), 2**63 - 1


class StreamOptions(StrictBody):
    include_usage: bool = False
    # vLLM's: with include_usage, every chunk carries the usage so far (its choice's tokens), not only the last
    continuous_usage_stats: bool | None = False


class TextPart(StrictBody):
    type: Literal["text"]
    text: Text


class ImageURL(StrictBody):
    url: Text  # data:image/...;base64,..., file: (--allowed-local-media-path), http(s): (--allowed-media-domains)
    # OpenAI's resolution choice: here the checkpoint's processor sets an image's size, so only "auto" is taken
    detail: Literal["auto"] | None = None


class ImagePart(StrictBody):
    """An image in a chat message (tinyserve/multimodal/chat.py): an image-text model's; any other refuses it."""

    type: Literal["image_url"]
    image_url: ImageURL


class ChatMessage(StrictBody):
    # What _content_unless_assistant checks, said in the schema: only an assistant turn may leave content out.
    model_config = StrictBody.model_config | ConfigDict(json_schema_extra={
        "if": {"properties": {"role": {"const": "assistant"}}, "required": ["role"]},
        "else": {"required": ["content"], "properties": {"content": {"not": {"type": "null"}}}}})
    # system, developer, user, assistant, tool; or any other role, handed to the chat template as vLLM does
    role: Text = Field(min_length=1)
    content: Text | list[TextPart | ImagePart] | None = None  # None only for an assistant turn (one that called tools)
    name: Text | None = None
    tool_calls: list[AssistantToolCall] | None = None  # an assistant turn's calls
    tool_call_id: Text | None = None  # a tool turn: the call it answers
    # An assistant turn's reasoning (vLLM 0.33's name; reasoning_content, its older one), handed to the
    # template under both names, as vLLM does: a reasoning model's template may show it again
    reasoning: Text | None = None
    reasoning_content: Text | None = None

    @model_validator(mode="after")
    def _content_unless_assistant(self) -> "ChatMessage":
        if self.content is None and self.role != "assistant":
            raise ValueError(f"content is required for a {self.role!r} message")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("tool_calls can only be given in an assistant message")
        return self

    def as_template_message(self) -> dict:
        content = self.content
        if isinstance(content, list) and any(isinstance(part, ImagePart) for part in content):
            content = [part.model_dump(exclude_none=True) for part in content]  # the renderer reads the images
        elif isinstance(content, list):
            content = "".join(part.text for part in content)
        message = {"role": self.role, "content": content or ""}
        if self.name is not None:  # a template may show who is speaking
            message["name"] = self.name
        if self.tool_calls:  # templates take the arguments as an object, as transformers documents
            message["tool_calls"] = [call.as_template_call() for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        reasoning = self.reasoning if self.reasoning is not None else self.reasoning_content
        if reasoning is not None and self.role == "assistant":
            message["reasoning"] = message["reasoning_content"] = reasoning
        return message


def token_id_keys(logit_bias: dict | None) -> dict | None:
    """logit_bias's keys must be token ids ("42"), as OpenAI sends them; every key that is not is named, as vLLM does."""
    bad = [key for key in logit_bias or () if not (key.isascii() and key.isdigit()) or int(key) >= INT64]
    if bad:
        raise ValueError(f"keys must be token ids; these cannot be converted to integer token IDs: {bad!r}")
    return logit_bias


class SamplingFields(ConstrainedFields):
    """Fields shared by chat and completions (and response_format, structured_outputs: ConstrainedFields)."""

    reports_ignored_fields: ClassVar[bool] = True
    model: Text | None = None
    # vLLM's: the answer's id is "chatcmpl-" or "cmpl-" and this, unless an x-request-id header names it (request_ids.py)
    request_id: Text | None = Field(None, max_length=MAX_REQUEST_ID_CHARS)
    n: int = Field(1, ge=1, le=128)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = Field(None, **SEED)
    stop: Text | list[Text] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    user: Text | None = None
    # vLLM's extras
    top_k: int | None = Field(None, ge=-1, lt=2**31)  # the sampler's int32; -1 and 0: off
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0, lt=2**31)
    # vLLM's: keep this many tokens of a longer prompt (a chat's: of the rendered conversation; -1: as many as
    # the context takes), from truncation_side's end ("left", the default, keeps the last ones); truncation.py
    truncate_prompt_tokens: int | None = Field(None, ge=-1, lt=INT64)
    truncation_side: Literal["left", "right"] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    priority: int = Field(0, ge=-INT64, lt=INT64)
    stop_token_ids: list[Annotated[int, Field(ge=0, lt=INT64)]] | None = None
    prompt_logprobs: int | None = Field(None, ge=-1, lt=2**31)  # of every prompt token after the first; -1: all
    # vLLM's: logprob tokens named "token_id:N"; None: as the server's --return-tokens-as-token-ids
    return_tokens_as_token_ids: bool | None = None
    # vLLM's: the answer carries the prompt's token ids (prompt_token_ids) and each choice's (token_ids), streamed
    # too: the prompt's with a choice's first chunk, each chunk's own tokens with it
    return_token_ids: bool | None = None
    # vLLM's: with logprobs, exactly these tokens' logprobs at each position (after the sampled token's), not the top
    logprob_token_ids: list[Annotated[int, Field(ge=0, lt=INT64)]] | None = Field(None, max_length=MAX_LOGPROB_TOKEN_IDS)
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = None  # {"token id": bias}
    # only these may be sampled (empty: nothing could be, a 400 as in vLLM)
    allowed_token_ids: list[Annotated[int, Field(ge=0, lt=INT64)]] | None = Field(None, min_length=1)
    bad_words: list[Text] | None = Field(None, max_length=MAX_NUM_BAD_WORDS)  # words the output must not contain
    # disaggregated prefill (distributed/kv_transfer/): {"do_remote_decode": true} to a prefill engine, what its
    # answer returned to a decode engine; checked by the engine's KV connector
    kv_transfer_params: dict[str, Any] | None = None

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_within_limits(cls, value):
        return cls.limits.check_stop(value)

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _logit_bias_within_limits(cls, value):
        return cls.limits.check_logit_bias(value)

    @field_validator("logit_bias")
    @classmethod
    def _token_id_keys(cls, value):
        return token_id_keys(value)

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> "SamplingFields":
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options can only be given with stream=true")
        if self.logprob_token_ids and (self.logprobs is None or self.logprobs is False):  # as vLLM
            raise InvalidInputError("when using `logprob_token_ids`, `logprobs` must be set", "logprob_token_ids")
        return self

    @field_validator("prompt_logprobs")
    @classmethod
    def _prompt_logprobs_not_streamed(cls, value, info: ValidationInfo):
        if value is not None and info.data.get("stream"):  # as vLLM: they come with the whole answer
            raise ValueError("is not available with stream=true")
        return value

    def sampling_params(self, max_tokens: int | None, logprobs: int | None, defaults: dict,
                        structured_outputs=None) -> SamplingParams:
        """defaults: the value of each of temperature, top_p, top_k, min_p, repetition_penalty
        when the request leaves it out (ServingContext.sampling_defaults); structured_outputs:
        the constraint (ConstrainedFields.constraint, or a tool_choice's)."""
        stop = [self.stop] if isinstance(self.stop, str) else self.stop

        def value(name: str):
            return defaults[name] if getattr(self, name) is None else getattr(self, name)

        return SamplingParams(
            n=self.n,
            temperature=value("temperature"),
            top_p=value("top_p"),
            top_k=value("top_k"),
            min_p=value("min_p"),
            seed=self.seed,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=stop or None,
            ignore_eos=self.ignore_eos,
            logprobs=0 if self.logprob_token_ids and logprobs is not None else logprobs,
            logprob_token_ids=self.logprob_token_ids or None,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=value("repetition_penalty"),
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            stop_token_ids=self.stop_token_ids or None,
            prompt_logprobs=self.prompt_logprobs,
            logit_bias={int(token_id): bias for token_id, bias in self.logit_bias.items()} if self.logit_bias else None,
            allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words or None,
            structured_outputs=structured_outputs,
            extra_args={"kv_transfer_params": self.kv_transfer_params} if self.kv_transfer_params is not None else None,
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """vLLM's continuous_usage_stats: usage in every streamed chunk; only with include_usage, as in vLLM."""
        return self.include_usage and bool(self.stream_options.continuous_usage_stats)


class ChatCompletionRequest(SamplingFields):
    refused_fields: ClassVar[str] = "chat"
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    # At most the server's --max-logprobs (20 unless set; the engine checks); -1: the whole vocabulary, as vLLM
    top_logprobs: int | None = Field(None, ge=-1, lt=2**31)
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # vLLM's: the reply continues the last message instead of opening a turn
    # vLLM's: the answer starts with the last message's content when that message is in the answer's role
    # (an assistant message the reply continues), as vLLM's echo does
    echo: bool = False
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: more variables for the template (enable_thinking)
    # With --reasoning-parser (tinyserve/reasoning/): the effort goes to the template as vLLM renders it
    # (reasoning_effort, and enable_thinking false for "none"), and include_reasoning false leaves the
    # reasoning out of the answer. Without one there is no reasoning to read, and both change nothing.
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    include_reasoning: bool = True
    tools: list[Tool] | None = Field(None, max_length=128)  # OpenAI's limit: each is shown to the template
    tool_choice: ToolChoice | None = None  # with tools: "auto" when left out, as OpenAI's
    parallel_tool_calls: bool = True

    @field_validator("messages", mode="before")
    @classmethod
    def _messages_within_limits(cls, value):
        return cls.limits.check_messages(value)

    @model_validator(mode="after")
    def _consistent_options(self) -> "ChatCompletionRequest":
        check_tool_choice(self.tools, self.tool_choice, self.constraint()[0] is not None)
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidInputError("top_logprobs needs logprobs=true", "top_logprobs")
        if self.continue_final_message and self.add_generation_prompt:
            raise InvalidInputError("continue_final_message and add_generation_prompt cannot both be true",
                                    "continue_final_message")
        return self

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def effective_tool_choice(self):
        """None (no tools), "none", "auto", "required" or a function's name as {"name": ...}."""
        if not self.tools:
            return None
        choice = self.tool_choice or "auto"
        return {"name": choice.function.name} if isinstance(choice, NamedToolChoice) else choice

    @property
    def template_tools(self) -> list[dict] | None:
        """The tools as chat templates take them (OpenAI's shape, as dicts)."""
        return [tool.model_dump(exclude_none=True) for tool in self.tools] if self.tools else None

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def echoed_text(self) -> str:
        """What echo puts before each choice's content: the last message's text if it is in the answer's role
        (the assistant's when a generation prompt opens its turn, else the last message's own), as vLLM."""
        if not self.echo:
            return ""
        last = self.messages[-1].as_template_message()
        role = "assistant" if self.add_generation_prompt else last["role"]
        return last["content"] if last["role"] == role else ""


class CompletionRequest(SamplingFields):
    refused_fields: ClassVar[str] = "completions"

    @model_validator(mode="before")
    @classmethod
    def _a_prompt(cls, data):
        """No prompt and no prompt_embeds (an empty list, vLLM's clients send it): the prompt is what is missing,
        in vLLM's words."""
        if isinstance(data, dict) and data.get("prompt") in (None, "") and data.get("prompt_embeds") in (None, []):
            raise InvalidInputError("Either prompt or prompt_embeds must be provided and non-empty.", "prompt")
        if isinstance(data, dict) and data.get("prompt_embeds") not in (None, []) and data.get("echo"):
            raise InvalidInputError("Echo is unsupported with prompt embeds.", "echo")  # vLLM's words
        return data

    prompt: Text | list[Text] | list[int] | list[list[int]] | None = None
    # --enable-prompt-embeds (tinyserve/prompt_embeds/): each a torch.save'd tensor [num_tokens, hidden_size] in
    # base64, one prompt each, answered before the prompts of `prompt` (as vLLM orders them)
    prompt_embeds: str | list[str] | None = None
    echo: bool = False
    max_tokens: int | None = Field(16, ge=0)  # 0 with echo: score the prompt, generate nothing (as vLLM)
    logprobs: int | None = Field(None, ge=-1, lt=2**31)  # as chat's top_logprobs: -1 is the whole vocabulary

    @field_validator("max_tokens")
    @classmethod
    def _zero_only_to_echo(cls, value, info: ValidationInfo):
        if value == 0 and not info.data.get("echo"):
            raise ValueError("can be 0 only with echo=true (to score the prompt)")
        return value

    @property
    def echo_only(self) -> bool:
        """echo with max_tokens 0: the answer is the prompt (and its logprobs), nothing generated."""
        return self.echo and self.max_tokens == 0

    @property
    def prompts(self) -> list:
        """Always a list of prompts: {"prompt_embeds": base64} dicts first, then strings or token-id lists."""
        embeds = [self.prompt_embeds] if isinstance(self.prompt_embeds, str) else self.prompt_embeds or []
        prompt = self.prompt
        if prompt is None:
            texts = []
        elif isinstance(prompt, str) or (prompt and all(isinstance(t, int) for t in prompt)):
            texts = [prompt]
        else:
            texts = list(prompt)
        return [{"prompt_embeds": e} for e in embeds] + texts


class TokenizeRequest(StrictBody):
    reports_ignored_fields: ClassVar[bool] = True
    model: Text | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool = True
    add_generation_prompt: bool = True  # with messages, rendered as a chat request would be
    continue_final_message: bool = False
    return_token_strs: bool = False  # vLLM's: the answer's token_strs, each token as the vocabulary spells it

    @field_validator("messages", mode="before")
    @classmethod
    def _messages_within_limits(cls, value):
        return cls.limits.check_messages(value)


class DetokenizeRequest(StrictBody):
    reports_ignored_fields: ClassVar[bool] = True
    model: Text | None = None
    tokens: list[int]
