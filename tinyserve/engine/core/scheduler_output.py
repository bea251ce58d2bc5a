"""SchedulerOutput: the record of everything one engine step decided, and all the worker learns of it.

The model runner executes it; the step span shows it. Nothing about a step is
decided anywhere else, and the worker reads nothing else: it may run in another
process (one per GPU under tensor parallelism), where the scheduler's Request
objects do not exist. So the worker keeps its own copy of each request, and this
is what crosses the seam to keep that copy current:

    SchedulerOutput(step_id=7)
    ├── scheduled_cached_requests   already held by the worker: only what changed
    │     CachedRequestData(a, computed=12, new=1, new_block_ids=[])       decode
    │     CachedRequestData(b, computed=16, new=8, new_block_ids=[31])     next prefill chunk
    ├── scheduled_new_requests      not held (or held without blocks): in full
    │     NewRequestData(c, prompt_token_ids, sampling_params, eos_token_ids,
    │                    block_ids=[4, 9], computed=16 (prefix-cache hit), new=5,
    │                    output_token_ids=[] — or, resumed after a preemption,
    │                    every token it had generated: they are recomputed too)
    ├── preempted_request_ids       their blocks were freed: the worker drops its block tables
    ├── finished_request_ids        finished or aborted since the previous step: the worker forgets them
    ├── scheduled_spec_decode_tokens  speculative decoding only: {a: [d1, d2, d3]}, drafts fed after
    │                               a's newest token (its new=4), verified in this one pass
    └── kv_connector_metadata       a KV connector only: the blocks to send to and receive from
                                    other engines (distributed/kv_transfer/)

The batch runs the cached requests first, then the new ones: the order the
scheduler's two loops chose them in (running requests, then waiting ones). The
tokens a cached request feeds are not sent: the worker has its prompt and the
tokens it sampled itself.
"""

from dataclasses import dataclass, field

from tinyserve.pooling_params import PoolingParams
from tinyserve.lora_request import LoRARequest
from tinyserve.sampling_params import SamplingParams
from tinyserve.wire.messages import MultiModalFeature, PromptEmbeds


@dataclass(slots=True)
class ScheduledRequest:
    """One request's share of the step: compute K/V for tokens [num_computed_tokens, +num_new_tokens)."""

    request_id: str
    num_computed_tokens: int
    num_new_tokens: int
    samples_token: bool  # True when this step reaches the end of the known tokens
    is_prefill: bool  # still inside its prompt (or recomputing after preemption)

    @property
    def num_cached_tokens(self) -> int:
        """Prefix-cache hit, counted in the step the request is scheduled from the waiting queue."""
        return 0


@dataclass(slots=True)
class NewRequestData(ScheduledRequest):
    """Scheduled for the first time, or again after a preemption: everything the worker needs, in full."""

    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: list[int]  # the sampler's min_tokens masks them, with sampling_params.stop_token_ids
    block_ids: list[int]  # the whole block table
    output_token_ids: list[int]  # empty, unless resumed after a preemption
    pooling_params: PoolingParams | None = None  # a pooling request's (pooling_runner.py)
    lora_request: LoRARequest | None = None  # its adapter (tinyserve/lora/), None: the base model
    prompt_embeds: PromptEmbeds | None = None  # its prompt as embeddings (tinyserve/prompt_embeds/)
    mm_features: list[MultiModalFeature] | None = None  # its images (tinyserve/multimodal/)

    @property
    def num_cached_tokens(self) -> int:
        # Scheduled from the waiting queue: it starts where its prefix-cache hit ends.
        return self.num_computed_tokens

    @property
    def token_ids(self) -> list[int]:
        """The num_new_tokens token ids this step feeds the model."""
        start = self.num_computed_tokens
        return (self.prompt_token_ids + self.output_token_ids)[start : start + self.num_new_tokens]


@dataclass(slots=True)
class CachedRequestData(ScheduledRequest):
    """Already held by the worker (scheduled in an earlier step, not preempted since): only what changed."""

    new_block_ids: list[int]  # appended to its block table since the worker last saw it
    # Pipeline parallelism only (vLLM's name): the token ids this step feeds. The stages before the last
    # sample nothing, so they learn the tokens the last stage sampled from here (pipeline_parallel/).
    new_token_ids: list[int] = field(default_factory=list)


@dataclass(slots=True)
class SchedulerOutput:
    step_id: int
    scheduled_cached_requests: list[CachedRequestData] = field(default_factory=list)
    scheduled_new_requests: list[NewRequestData] = field(default_factory=list)
    preempted_request_ids: list[str] = field(default_factory=list)
    finished_request_ids: list[str] = field(default_factory=list)  # since the previous step
    num_waiting: int = 0
    num_running: int = 0
    num_kv_blocks_used: int = 0
    num_kv_blocks_total: int = 0
    token_budget: int = 0
    # Structured outputs (engine/structured_output.py): row i of grammar_bitmask, ceil(vocab_size / 32)
    # int32 words, is the tokens structured_output_request_ids[i] may sample. Raw bytes (native byte
    # order), so that the step still encodes with msgspec for the tensor-parallel ranks.
    structured_output_request_ids: list[str] = field(default_factory=list)
    grammar_bitmask: bytes | None = None
    grammar_bitmask_time: float = 0.0  # seconds spent filling it
    # Speculative decoding (tinyserve/spec_decode/, vLLM's name): the drafts each decoding request feeds
    # after its newest token; its num_new_tokens counts them. Empty without speculation.
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    # A KV connector (distributed/kv_transfer/, vLLM's name): what its worker side sends and receives from
    # this step on, built by the scheduler side (KVConnectorMetadata). None without one.
    kv_connector_metadata: object = None

    @property
    def scheduled(self) -> list[ScheduledRequest]:
        """The batch, in order: the cached requests, then the new ones."""
        return [*self.scheduled_cached_requests, *self.scheduled_new_requests]

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(r.num_new_tokens for r in self.scheduled)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(r.num_new_tokens for r in self.scheduled if r.is_prefill)

    @property
    def num_decode_tokens(self) -> int:
        return sum(r.num_new_tokens for r in self.scheduled if not r.is_prefill)

    @property
    def num_prefill_requests(self) -> int:
        return sum(1 for r in self.scheduled if r.is_prefill)

    @property
    def num_decode_requests(self) -> int:
        return sum(1 for r in self.scheduled if not r.is_prefill)

    @property
    def is_empty(self) -> bool:
        return not (self.scheduled_cached_requests or self.scheduled_new_requests)
