"""The messages that cross between the API process and an engine process.

Every message is a typed msgspec Struct, encoded as msgpack and decoded into the
same type on the other side: nothing is pickled, and a malformed message fails
to decode instead of running code.

    api ── EngineCoreRequest ──────► engine     (stage ④: a new request)
    api ── EngineCoreAbort ────────► engine     (client went away, stop string hit)
    api ── UtilityCall ────────────► engine     (stats, reset prefix cache, ...: ipc.py)
    api ◄── EngineCoreOutputs ─────── engine    (stage ⑦: new tokens of one step)
"""

import msgspec

from tinyserve.pooling_params import PoolingParams
from tinyserve.lora_request import LoRARequest
from tinyserve.sampling_params import SamplingParams


class ReasoningEnd(msgspec.Struct, array_like=True, omit_defaults=True):
    """Where a constrained request's reasoning ends, as the front end's reasoning parser (tinyserve/reasoning/)
    hands it over when the prompt leaves the reasoning open: until one of end_token_ids is in the output the
    model reasons freely, and its grammar starts with the token after it (vLLM's reasoning_ended).

    masked_token_ids: tokens that would end the reasoning implicitly, the end being also the content's first
    token (Qwen3's <tool_call>); no constraint here starts with one, so while the request reasons they are
    masked, as vLLM masks such an end its grammar would not take."""

    end_token_ids: list[int]
    masked_token_ids: list[int] = []


class PromptEmbeds(msgspec.Struct, array_like=True):
    """A prompt given as embeddings (--enable-prompt-embeds: tinyserve/prompt_embeds/): one row per prompt
    position, in place of the embedding of a token, as raw bytes (msgpack carries bytes as they are)."""

    data: bytes  # rows x hidden_size values of `dtype`, row after row
    rows: int
    hidden_size: int
    dtype: str  # torch's name without "torch.": "float32", "bfloat16", "float16"


class MultiModalFeature(msgspec.Struct, array_like=True):
    """One image of a prompt (vLLM's MultiModalFeatureSpec, tinyserve/multimodal/): its content hash, where
    its placeholder tokens are in the prompt (vLLM's PlaceholderRange), and its pixels as the checkpoint's
    processor made them, as raw bytes."""

    identifier: str  # vLLM's mm_hash: the SHA-256 of the image's pixels, in hex
    offset: int  # the position of its first placeholder token
    length: int  # how many placeholder tokens: the rows the image encoder gives it
    pixel_values: bytes  # float32 values, C order
    shape: list[int]  # [channels, height, width]


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: list[int]
    arrival_time: float
    priority: int = 0
    # W3C trace context (traceparent/tracestate); empty when tracing is off.
    trace_context: dict[str, str] = {}
    # A pooling request (--runner pooling): a vector from the prompt, no tokens. Its sampling_params
    # are then pooling_params.POOLING_SAMPLING_PARAMS, which nothing samples with.
    pooling_params: PoolingParams | None = None
    lora_request: LoRARequest | None = None  # the adapter it runs under (tinyserve/lora/); None: the base model
    # Which API process sent it (--api-server-count N: 0..N-1; vLLM's field): its outputs go back to that one.
    client_index: int = 0
    # A constraint's grammar starts after the reasoning (ReasoningEnd); None: from the first output token.
    reasoning_end: ReasoningEnd | None = None
    # A prompt given as embeddings: prompt_token_ids are then `rows` placeholders (0s, as vLLM's), which
    # the scheduler counts as the prompt's tokens and the model never looks up.
    prompt_embeds: PromptEmbeds | None = None
    # Its images, in prompt order (tinyserve/multimodal/): each one's rows stand at its placeholder tokens.
    mm_features: list[MultiModalFeature] | None = None


class TokenLogprobs(msgspec.Struct, array_like=True):
    """Logprobs at one position: parallel lists, the sampled token first."""

    token_ids: list[int]
    logprobs: list[float]
    ranks: list[int]


class RequestTimes(msgspec.Struct, array_like=True, omit_defaults=True):
    """The engine's own timestamps (time.time()) for one finished request."""

    arrival_time: float
    queued_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    token_times: list[float] = []
    prefill_chunks: list[tuple[float, int]] = []  # (time, tokens) per prefill step
    preemption_times: list[float] = []
    # Structured outputs: when the request's grammar was asked for and ready, and whether it was cached.
    structured_output_start: float | None = None
    structured_output_end: float | None = None
    structured_output_cache_hit: bool = False
    # The output tokens before its grammar started: 0, or the reasoning and its end (a ReasoningEnd); -1: never
    structured_output_grammar_start: int = 0


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    # With the first token, when asked for: one entry per prompt token after the first.
    prompt_logprobs: list[TokenLogprobs] | None = None
    times: RequestTimes | None = None  # set once, when the request finishes
    # Why the engine ended the request itself, for its client (finish_reason "abort"): a grammar that could
    # not be compiled, or not within the compile deadline. The front end raises it as the request's error.
    error: str | None = None
    # The request field at fault, for the 400 the front end answers: "structured_outputs" for a grammar,
    # "model" for a LoRA adapter that cannot be loaded, ...; None: the request as a whole.
    error_param: str | None = None
    # A pooling request's vector (float32 values), on its one and only output.
    pooling_output: list[float] | None = None
    # Disaggregated prefill (distributed/kv_transfer/), vLLM's: where another engine can pull this request's
    # prompt K/V from (do_remote_prefill, remote_host, remote_port, remote_block_ids, ...), once finished.
    kv_transfer_params: dict | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class SpecDecodingStats(msgspec.Struct, array_like=True, omit_defaults=True):
    """Speculative decoding's counters, cumulative (vLLM's SpecDecodingStats; tinyserve/spec_decode/)."""

    num_spec_tokens: int = 0  # num_speculative_tokens: the positions of num_accepted_tokens_per_pos
    num_drafts: int = 0  # verifications: one per request per step that had drafts
    num_draft_tokens: int = 0  # drafts verified
    num_accepted_tokens: int = 0  # drafts accepted
    num_accepted_tokens_per_pos: list[int] = []  # accepted drafts by position in their draft (0-based)


class MultiModalCacheStats(msgspec.Struct, array_like=True, omit_defaults=True):
    """The image encoder cache's counters, cumulative, in images (vLLM's mm_cache_queries / mm_cache_hits;
    tinyserve/multimodal/)."""

    queries: int = 0  # images looked up: each image each step that computes some of its placeholders
    hits: int = 0  # those found encoded already


class SchedulerStats(msgspec.Struct, array_like=True, omit_defaults=True):
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0  # fraction of KV blocks in use, 0..1
    num_kv_blocks_used: int = 0
    num_kv_blocks_total: int = 0
    prefix_cache_queries: int = 0  # tokens looked up in the prefix cache (cumulative)
    prefix_cache_hits: int = 0  # tokens found there (cumulative)
    num_preemptions: int = 0  # cumulative
    step_id: int = 0
    # Of the waiting: those that cannot be scheduled yet whatever the room (their grammar is still being
    # compiled), vLLM's "deferred" waiting requests; the rest wait for room ("capacity").
    num_waiting_deferred_reqs: int = 0
    spec_decoding_stats: SpecDecodingStats | None = None  # an engine with --speculative-config
    mm_cache_stats: MultiModalCacheStats | None = None  # an engine of an image-text model


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True):
    engine_index: int = 0
    timestamp: float = 0.0
    outputs: list[EngineCoreOutput] = []
    scheduler_stats: SchedulerStats | None = None
