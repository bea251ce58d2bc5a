"""A request as the engine sees it: token ids, progress, and a state machine.

    WAITING ──schedule──► RUNNING ──stop / length──► FINISHED_STOPPED / FINISHED_LENGTH
       ▲                     │
       └──── PREEMPTED ◄─────┘  (KV pool full: blocks freed, recomputed later)
    any state ──abort──► FINISHED_ABORTED

    WAITING ──► WAITING_FOR_REMOTE_KVS ──► WAITING   (a KV connector: its prompt's K/V arrive from
                                                      another engine; distributed/kv_transfer/)

There are no separate prefill and decode phases. A request only knows how many of
its tokens already have K/V in the cache (`num_computed_tokens`); each step the
scheduler decides how many more to compute. While that count is behind the
prompt, the request is "in prefill"; once it is one behind `num_tokens`, each step
computes the newest token and samples the next one ("decode").
"""

import enum
import functools
import hashlib
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

import msgspec

from tinyserve.lora_request import LoRARequest
from tinyserve.wire.messages import EngineCoreRequest, MultiModalFeature, PromptEmbeds, ReasoningEnd, RequestTimes
from tinyserve.pooling_params import PoolingParams
from tinyserve.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"  # blocks allocated, K/V arriving (distributed/kv_transfer/)
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def is_finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED)

    @property
    def finish_reason(self) -> str | None:
        return self.value if self.is_finished else None


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: list[int]
    arrival_time: float
    priority: int = 0
    trace_context: dict[str, str] = field(default_factory=dict)
    pooling_params: PoolingParams | None = None  # a pooling request: a vector, no tokens (pooling_scheduler.py)
    lora_request: LoRARequest | None = None
    client_index: int = 0  # the API process that sent it (vLLM's field; engine/client_outputs.py routes by it)
    reasoning_end: ReasoningEnd | None = None  # its grammar starts after the reasoning ends (None: at once)
    prompt_embeds: PromptEmbeds | None = None  # its prompt as embeddings (tinyserve/prompt_embeds/), else None
    mm_features: list[MultiModalFeature] | None = None  # its images (tinyserve/multimodal/), else None

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prefix-cache hit at first scheduling; -1 = not yet scheduled
    stop_reason: int | str | None = None
    times: RequestTimes = field(init=False)  # the engine's timestamps, from arrival on
    # sampling_params.prompt_logprobs: those computed so far, prompt positions 1, 2, ...
    prompt_logprobs: list = field(default_factory=list)
    # Structured outputs: a Future of the request's grammar, compiled by the StructuredOutputManager
    # (engine/structured_output.py) in its threads. The scheduler admits the request once it is done.
    grammar: Future | None = None
    # Speculative decoding (tinyserve/spec_decode/): drafts of its next tokens, proposed by the worker
    # in the previous step, verified by the next one (vLLM's spec_token_ids). Empty without speculation.
    spec_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)
        # Disaggregated prefill (distributed/kv_transfer/): where its prompt's K/V come from or go to, as vLLM
        # reads it from SamplingParams.extra_args; a copy, as the connector marks it used.
        extra_args = self.sampling_params.extra_args or {}
        self.kv_transfer_params = dict(extra_args["kv_transfer_params"]) \
            if extra_args.get("kv_transfer_params") is not None else None
        self.times = RequestTimes(arrival_time=self.arrival_time, queued_time=time.time())
        # Structured outputs after a reasoning parser's reasoning (vLLM's reasoning_ended): until the end token
        # is sampled, the grammar neither masks (engine/structured_output.py) nor advances (append_output_token).
        self.reasoning_ended = self.reasoning_end is None
        if not self.reasoning_ended:
            self.times.structured_output_grammar_start = -1
        self.stop_token_ids = set(self.sampling_params.stop_token_ids or ())
        if not self.sampling_params.ignore_eos:
            self.stop_token_ids.update(self.eos_token_ids)

    @classmethod
    def from_engine_core_request(cls, req: EngineCoreRequest) -> "Request":
        """The wire's fields are this class's first ones, by the same names."""
        return cls(**msgspec.structs.asdict(req))

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus output tokens: everything whose K/V must eventually be computed."""
        return len(self.all_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        """The known tokens and the drafts: what the next step may compute K/V for."""
        return len(self.all_token_ids) + len(self.spec_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def block_hash_root(self) -> bytes:
        """What the prefix cache chains the first block's hash from: b"" for the base model.

        An adapter changes every K and V, so the same prompt under two adapters (or under one
        and the base model) is different KV: its blocks must never be shared. The adapter's
        id, name and path all go into the root, so a name loaded again from elsewhere gets
        its own blocks too.

        A prompt given as embeddings has placeholder token ids (all 0): two such prompts would hash
        alike whatever their rows. The SHA-256 of its rows goes into the root, so only the same
        embeddings share blocks (vLLM hashes them into each block's key; here, into the chain's start).

        An image's placeholder tokens are all the same id whatever the image: block_extra_key adds its
        content hash to each block its placeholders cover, as vLLM does, not to the root.
        """
        lora = self.lora_request
        root = b"" if lora is None else f"lora\x00{lora.lora_int_id}\x00{lora.lora_name}\x00{lora.lora_path}".encode()
        if self.prompt_embeds is not None:
            root += b"embeds\x00" + self._embeds_digest
        return root

    def block_extra_key(self, start: int, end: int) -> bytes:
        """What a full block of tokens [start, end) adds to its parent's hash besides its tokens: the content
        hashes (mm_hash) of the images whose placeholders it covers (b"" for a block without any), as vLLM's
        extra keys. The same text with another image is then another block from the image's first placeholder
        on, while the text before the image is shared with any prompt that has it (the chain carries the rest)."""
        if not self.mm_features:
            return b""
        covered = [f.identifier for f in self.mm_features if f.offset < end and start < f.offset + f.length]
        return b"images\x00" + "\x00".join(covered).encode() if covered else b""

    @functools.cached_property
    def _embeds_digest(self) -> bytes:
        return hashlib.sha256(self.prompt_embeds.data).digest()

    @property
    def waiting_for_grammar(self) -> bool:
        return self.grammar is not None and not self.grammar.done()

    def append_output_token(self, token_id: int, now: float) -> None:
        if self.grammar is not None:
            self._advance_grammar(token_id)
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        if self.times.first_token_time is None:
            self.times.first_token_time = now
        self.times.token_times.append(now)

    def _advance_grammar(self, token_id: int) -> None:
        """The sampled token into the request's grammar, which accepts it: the sampler kept to its bitmask (once
        the grammar ended, only EOS was allowed: ignore_eos goes on with EOS). While the reasoning is open the
        token is only looked at: the one that ends the reasoning starts the grammar with the next token."""
        if not self.reasoning_ended:
            if token_id in self.reasoning_end.end_token_ids:
                self.reasoning_ended = True
                self.times.structured_output_grammar_start = self.num_output_tokens + 1
            return
        grammar = self.grammar.result()
        if not grammar.is_terminated:
            grammar.accept(token_id)
