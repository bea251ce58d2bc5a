"""What the two halves of a KV connector, and two engines' connectors, tell each other (msgspec Structs).

    scheduler side ── KVConnectorMetadata (in SchedulerOutput) ──► worker side    this step's sends and receives
    scheduler side ◄── KVConnectorOutput (in ModelRunnerOutput) ── worker side    the ones that completed
    consumer ── PullRequest ──► producer's side channel ── PullReply (+ the blocks) ──► consumer ── PullDone ──►

Nothing here imports torch: the scheduler side reads these too.
"""

import hashlib
from array import array

import msgspec


def prompt_hash(token_ids: list[int]) -> str:
    """A prompt's fingerprint: a consumer pulls only K/V computed for the very prompt it was given."""
    return hashlib.sha256(array("q", token_ids).tobytes()).hexdigest()


class RecvSpec(msgspec.Struct, array_like=True):
    """Pull remote_block_ids of remote_request_id from the producer's side channel into local_block_ids."""

    request_id: str
    local_block_ids: list[int]
    remote_request_id: str
    remote_block_ids: list[int]
    remote_host: str
    remote_port: int
    prompt_hash: str
    num_tokens: int  # the prompt's: the slots of the received blocks checked before they are used
    trace_context: dict[str, str] = {}


class SendSpec(msgspec.Struct, array_like=True):
    """A finished prefill's blocks, kept for a consumer to pull until `deadline` (time.time())."""

    request_id: str
    block_ids: list[int]
    prompt_hash: str
    deadline: float
    trace_context: dict[str, str] = {}


class KVConnectorMetadata(msgspec.Struct, array_like=True):
    """vLLM's KVConnectorMetadata: built by the scheduler side each step, read by the worker side."""

    reqs_to_recv: list[RecvSpec] = []
    reqs_to_send: list[SendSpec] = []


class KVConnectorOutput(msgspec.Struct, array_like=True):
    """vLLM's KVConnectorOutput: sends and receives that completed since the last step."""

    finished_sending: list[str] = []  # pulled (or expired unpulled): their blocks may be freed
    finished_recving: list[str] = []  # landed: the request may be scheduled
    failed_recving: dict[str, str] = {}  # request id -> why its pull failed


class KVLayout(msgspec.Struct, array_like=True, frozen=True):
    """The KV cache's shape per layer, [2, num_blocks, block_size, num_kv_heads, head_dim] of dtype: both
    engines must agree on it for blocks to move whole."""

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str


class PullRequest(msgspec.Struct, tag="pull", array_like=True):
    request_id: str  # the producer's
    block_ids: list[int]  # the producer's
    prompt_hash: str
    layout: KVLayout
    kv_connector: str


class PullDone(msgspec.Struct, tag="done", array_like=True):
    request_id: str  # the producer's: its blocks may be freed


class PullReply(msgspec.Struct, array_like=True, omit_defaults=True):
    """error, or what the consumer needs to read the blocks: with ZeroMQ the frames after this one hold
    them, a layer each; with Mooncake, the producer's transfer session and each layer's address."""

    error: str | None = None
    num_bytes: int = 0
    mooncake_session: str | None = None
    num_blocks: int = 0  # blocks in each of the producer's layers: where its values start
    layer_addresses: list[int] = []


SIDE_CHANNEL_MESSAGE = PullRequest | PullDone
