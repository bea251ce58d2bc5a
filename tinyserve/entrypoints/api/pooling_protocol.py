"""The bodies of the pooling endpoints (--runner pooling): /v1/embeddings (OpenAI's) and /pooling (vLLM's).

    input            a text, a list of texts, a list of token ids, or a list of them: one vector each
    encoding_format  "float" (a list of numbers) or "base64" (the float32 values, little-endian, base64)
    dimensions       a shorter vector: refused (PoolingParams says why)
    normalize        vLLM's: null keeps the server's --pooler-config, true/false overrides it
    add_special_tokens, priority, request_id: vLLM's, as for completions
"""

from typing import ClassVar, Literal

from pydantic import Field

from tinyserve.entrypoints.api.guards.strict_body import StrictBody, Text
from tinyserve.entrypoints.api.openai_protocol import INT64
from tinyserve.entrypoints.api.request_ids import MAX_REQUEST_ID_CHARS
from tinyserve.pooling_params import PoolingParams


class EmbeddingRequest(StrictBody):
    refused_fields: ClassVar[str] = "embeddings"
    reports_ignored_fields: ClassVar[bool] = True
    model: Text | None = None
    input: Text | list[Text] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: Text | None = None
    normalize: bool | None = None
    add_special_tokens: bool = True
    priority: int = Field(0, ge=-INT64, lt=INT64)
    request_id: Text | None = Field(None, max_length=MAX_REQUEST_ID_CHARS)

    @property
    def inputs(self) -> list:
        """Always a list of inputs: texts or token-id lists."""
        given = self.input
        if isinstance(given, str) or (given and all(isinstance(t, int) for t in given)):
            return [given]
        return list(given)

    def pooling_params(self) -> PoolingParams:
        return PoolingParams(task="embed", normalize=self.normalize, dimensions=self.dimensions)


class PoolingRequest(EmbeddingRequest):
    """vLLM's /pooling: the same body (its task is the server's, "embed" here), answered with `data` lists."""

    refused_fields: ClassVar[str] = "pooling"
    task: Literal["embed"] | None = None
