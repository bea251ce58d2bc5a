"""The bodies of the pooling endpoints (--runner pooling): /v1/embeddings (OpenAI's) and /pooling (vLLM's).

    input            a text, a list of texts, a list of token ids, or a list of them: one vector each
    messages         vLLM's: instead of input, a conversation (or a list of them), rendered with the chat
                     template (add_generation_prompt, continue_final_message, chat_template_kwargs as for a
                     chat; no generation prompt unless asked for), one vector each
    encoding_format  "float" (a list of numbers), "base64" (the values' bytes, base64), or vLLM's "bytes"
                     (the bytes as the body, application/octet-stream, where each vector lies in a JSON
                     `metadata` header) and "bytes_only" (the bytes alone)
    embed_dtype      vLLM's: the bytes' type for base64 and bytes: float32 (default), float16, bfloat16,
                     fp8_e4m3, fp8_e5m2 (a float list is the float32 values whatever it says)
    endianness       vLLM's: the bytes' order: "native" (this machine's, the default), "little", "big"
    dimensions       a shorter vector: refused (PoolingParams says why)
    use_activation   vLLM's: an embedding's activation is its L2 normalisation; null keeps the server's
                     --pooler-config (normalised by default), false gives the raw pooled state
    normalize        vLLM's older name for use_activation
    padding          vLLM's: "max_length" pads the prompt with the tokenizer's pad token to max_model_len
                     tokens (models trained at a fixed length); "do_not_pad" (the default) leaves it
    truncate_prompt_tokens, truncation_side: vLLM's, as for completions (truncation.py), but keeping the
                     first tokens unless truncation_side says "left", and -1 the whole context
    add_special_tokens, priority, request_id: vLLM's, as for completions (add_special_tokens: false for
                     messages, whose template adds them)
"""

from typing import Any, ClassVar, Literal

from pydantic import Field, model_validator

from tinyserve.entrypoints.api.guards.strict_body import StrictBody, Text
from tinyserve.entrypoints.api.openai_protocol import INT64, ChatMessage
from tinyserve.entrypoints.api.request_ids import MAX_REQUEST_ID_CHARS
from tinyserve.errors import InvalidInputError
from tinyserve.pooling_params import PoolingParams

EMBED_DTYPES = ("float32", "float16", "bfloat16", "fp8_e4m3", "fp8_e5m2")  # vLLM's


class EmbeddingRequest(StrictBody):
    refused_fields: ClassVar[str] = "embeddings"
    reports_ignored_fields: ClassVar[bool] = True
    model: Text | None = None
    input: Text | list[Text] | list[int] | list[list[int]] | None = None
    messages: list[ChatMessage] | list[list[ChatMessage]] | None = Field(None, min_length=1)
    add_generation_prompt: bool = False
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    encoding_format: Literal["float", "base64", "bytes", "bytes_only"] = "float"
    embed_dtype: Literal[EMBED_DTYPES] = "float32"
    endianness: Literal["native", "little", "big"] = "native"
    dimensions: int | None = None
    user: Text | None = None
    use_activation: bool | None = None
    normalize: bool | None = None
    padding: Literal["max_length", "do_not_pad"] | None = None
    add_special_tokens: bool | None = None  # None: true for input, false for messages (the template adds them)
    truncate_prompt_tokens: int | None = Field(None, ge=-1, lt=INT64)
    truncation_side: Literal["left", "right"] | None = None
    priority: int = Field(0, ge=-INT64, lt=INT64)
    request_id: Text | None = Field(None, max_length=MAX_REQUEST_ID_CHARS)

    @model_validator(mode="after")
    def _input_or_messages(self) -> "EmbeddingRequest":
        if (self.input is None) == (self.messages is None):
            raise InvalidInputError("give either input or messages", "input" if self.input is None else "messages")
        if self.use_activation is not None and self.normalize is not None and self.use_activation != self.normalize:
            raise InvalidInputError("use_activation and normalize (its older name) disagree", "use_activation")
        if self.continue_final_message and self.add_generation_prompt:
            raise InvalidInputError("continue_final_message and add_generation_prompt cannot both be true",
                                    "continue_final_message")
        return self

    @property
    def inputs(self) -> list:
        """Always a list of inputs: texts or token-id lists, or conversations (lists of template messages)."""
        if self.messages is not None:
            conversations = self.messages if isinstance(self.messages[0], list) else [self.messages]
            return [[message.as_template_message() for message in conversation] for conversation in conversations]
        given = self.input
        if isinstance(given, str) or (given and all(isinstance(t, int) for t in given)):
            return [given]
        return list(given)

    @property
    def special_tokens(self) -> bool:
        return self.add_special_tokens if self.add_special_tokens is not None else self.messages is None

    def pooling_params(self) -> PoolingParams:
        normalize = self.use_activation if self.use_activation is not None else self.normalize
        return PoolingParams(task="embed", normalize=normalize, dimensions=self.dimensions)


class PoolingRequest(EmbeddingRequest):
    """vLLM's /pooling: the same body (its task is the server's, "embed" here), answered with `data` lists."""

    refused_fields: ClassVar[str] = "pooling"
    task: Literal["embed"] | None = None
