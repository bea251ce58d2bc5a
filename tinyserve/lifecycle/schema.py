"""The span schema: every span name and attribute key tinyserve emits, in one place.

No other module invents a span name or an attribute key; they import them from
here, and so do the readers (load_run, exporters, plots). A request's trace:

    POST /v1/chat/completions                    api      (HTTP server span, the root)
    └── chat {model}                             api      (the request, GenAI attributes)
        ├── tinyserve.render                     api      (template + tokenize; logged inputs)
        ├── tinyserve.enqueue                    api      (add_request, engine chosen)
        ├── tinyserve.ipc.send                   api      (encode + send over ZeroMQ)
        ├── tinyserve.queue                      engine   (arrival → first scheduled)
        ├── tinyserve.structured_output          engine   (grammar asked for → ready; constrained requests)
        ├── tinyserve.prefill                    engine   (first scheduled → first token)
        ├── tinyserve.decode                     engine   (first token → finish)
        └── tinyserve.detokenize                 api      (incremental detokenization)
    └── tinyserve.respond                        api      (first byte → last byte sent)

Each engine also writes one trace per step:

    tinyserve.step  (links → the `chat {model}` span of every request it served)
    ├── tinyserve.schedule
    ├── tinyserve.execute            one per tensor-parallel rank (tinyserve.tp.*), if any;
    │   │                            one per rank of each pipeline stage (tinyserve.pp.*)
    │   └── tinyserve.encode         the image encoder, where the step encoded images (multimodal/)
    └── tinyserve.update

The module is over 300 lines because every name is here, in one place, with what it means.
"""

# ---- services (resource attribute service.name) ------------------------------
SERVICE_API = "tinyserve-api"
SERVICE_OFFLINE = "tinyserve-offline"
SERVICE_ROUTER = "tinyserve-router"  # `tinyserve router`, in front of several servers


def engine_service_name(engine_index: int) -> str:
    return f"tinyserve-engine-{engine_index}"


def api_service_name(api_server_index: int | None) -> str:
    """tinyserve-api; API process i of several (--api-server-count): tinyserve-api-<i>."""
    return SERVICE_API if api_server_index is None else f"{SERVICE_API}-{api_server_index}"


# ---- resource attributes: which machine and rank a process is -----------------------
RESOURCE_HOST = "host.name"  # OpenTelemetry's semantic convention
RESOURCE_DP_RANK = "tinyserve.dp.rank"  # an engine's data-parallel rank (its engine index)
RESOURCE_TP_RANK = "tinyserve.tp.rank"  # the tensor-parallel rank that writes the engine's spans: 0
RESOURCE_API_SERVER_INDEX = "tinyserve.api_server.index"  # which of --api-server-count API processes (0..N-1)


# ---- span names ----------------------------------------------------------------
def request_span_name(operation: str, model: str) -> str:
    """`chat {model}` or `text_completion {model}` (GenAI semantic conventions)."""
    return f"{operation} {model}"


OPERATION_CHAT = "chat"
OPERATION_TEXT_COMPLETION = "text_completion"
OPERATION_EMBEDDINGS = "embeddings"  # a pooling request (--runner pooling): /v1/embeddings, /pooling, LLM.embed

RENDER = "tinyserve.render"
ENQUEUE = "tinyserve.enqueue"
IPC_SEND = "tinyserve.ipc.send"
QUEUE = "tinyserve.queue"
PREFILL = "tinyserve.prefill"
DECODE = "tinyserve.decode"
DETOKENIZE = "tinyserve.detokenize"
RESPOND = "tinyserve.respond"
STEP = "tinyserve.step"
# The parent of an engine's steps over one window of time (TIMELINE_WINDOW_S): a trace of its own, so that
# an OTLP viewer's trace list shows requests (one trace each) and a bounded number of engine timelines,
# not a trace per step. Steps link to the requests they served; a request's prefill and decode spans link
# back to the timelines its steps are in.
ENGINE_TIMELINE = "tinyserve.engine_timeline"
TIMELINE_WINDOW_S = 60.0
SCHEDULE = "tinyserve.schedule"
EXECUTE = "tinyserve.execute"
UPDATE = "tinyserve.update"
STRUCTURED_OUTPUT = "tinyserve.structured_output"  # only for requests with structured_outputs

API_STAGES = (RENDER, ENQUEUE, IPC_SEND, DETOKENIZE)
ENGINE_STAGES = (QUEUE, PREFILL, DECODE)
REQUEST_STAGES = (RENDER, ENQUEUE, IPC_SEND, QUEUE, PREFILL, DECODE, DETOKENIZE, RESPOND)

# ---- events ----------------------------------------------------------------------
EVENT_PREFILL_CHUNK = "prefill_chunk"  # on tinyserve.prefill, one per step that computed prompt tokens
EVENT_PREEMPTED = "preempted"  # on tinyserve.prefill / tinyserve.decode

# ---- GenAI semantic-convention attributes (on `chat {model}`) ------------------
GEN_AI_OPERATION_NAME = "gen_ai.operation.name"
GEN_AI_PROVIDER_NAME = "gen_ai.provider.name"
GEN_AI_REQUEST_MODEL = "gen_ai.request.model"
GEN_AI_REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
GEN_AI_REQUEST_TEMPERATURE = "gen_ai.request.temperature"
GEN_AI_REQUEST_TOP_P = "gen_ai.request.top_p"
GEN_AI_REQUEST_SEED = "gen_ai.request.seed"
GEN_AI_RESPONSE_ID = "gen_ai.response.id"
GEN_AI_RESPONSE_FINISH_REASONS = "gen_ai.response.finish_reasons"
GEN_AI_USAGE_INPUT_TOKENS = "gen_ai.usage.input_tokens"
GEN_AI_USAGE_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
GEN_AI_RESPONSE_MODEL = "gen_ai.response.model"
# OpenInference's names (Phoenix, Langfuse and other LLM viewers show these on the request span): its
# kind always; the prompt and the output text unless --trace-redact-inputs, as the logged inputs.
OPENINFERENCE_SPAN_KIND = "openinference.span.kind"
OPENINFERENCE_LLM = "LLM"
INPUT_VALUE = "input.value"
INPUT_MIME_TYPE = "input.mime_type"
OUTPUT_VALUE = "output.value"
OUTPUT_MIME_TYPE = "output.mime_type"
LLM_MODEL_NAME = "llm.model_name"
LLM_TOKEN_COUNT_PROMPT = "llm.token_count.prompt"
LLM_TOKEN_COUNT_COMPLETION = "llm.token_count.completion"
LLM_TOKEN_COUNT_TOTAL = "llm.token_count.total"
PROVIDER = "tinyserve"

# ---- tinyserve's own attributes --------------------------------------------------
REQUEST_ID = "tinyserve.request_id"  # the engine request id (a child id when n > 1)
PARENT_REQUEST_ID = "tinyserve.parent_request_id"
ENGINE_INDEX = "tinyserve.engine_index"
# logged inputs (tinyserve.render) and outputs (the request span): all replay needs
MESSAGES = "tinyserve.messages"  # JSON of the chat messages
PROMPT = "tinyserve.prompt"  # the prompt text (rendered, for chat)
PROMPT_TOKEN_IDS = "tinyserve.prompt_token_ids"
NUM_PROMPT_TOKENS = "tinyserve.num_prompt_tokens"
SAMPLING_PARAMS = "tinyserve.sampling_params"  # JSON, with the seed
POOLING_PARAMS = "tinyserve.pooling_params"  # JSON: a pooling request's, in place of SAMPLING_PARAMS
POOLING_DIMENSIONS = "tinyserve.pooling.dimensions"  # the length of the vector a pooling request got
OUTPUT_TOKEN_IDS = "tinyserve.output_token_ids"  # first completion's ids
OUTPUT_TEXT = "tinyserve.output_text"  # first completion's text
COMPLETIONS = "tinyserve.completions"  # JSON list: index, token_ids, text, finish_reason per completion
INPUTS_REDACTED = "tinyserve.inputs_redacted"
ERROR_REASON = "tinyserve.error"
# ipc.send
IPC_BYTES = "tinyserve.ipc.bytes"
IPC_SOCKET = "tinyserve.ipc.socket"
# queue / prefill / decode
QUEUE_DEPTH_AT_ARRIVAL = "tinyserve.queue_depth_at_arrival"
NUM_CACHED_TOKENS = "tinyserve.num_cached_tokens"
CHUNK_TOKENS = "tinyserve.chunk_tokens"  # on a prefill_chunk event
NUM_OUTPUT_TOKENS = "tinyserve.num_output_tokens"
TOKEN_TIMES = "tinyserve.token_times_unix_nano"  # one timestamp per output token
NUM_PREEMPTIONS = "tinyserve.num_preemptions"
FINISH_REASON = "tinyserve.finish_reason"
# structured_output: the constraint's kind (json, regex, choice, grammar, json_object), whether its
# grammar was already compiled (or compiling) for an earlier request, and the backend's library
STRUCTURED_OUTPUT_KIND = "tinyserve.structured_output.kind"
STRUCTURED_OUTPUT_CACHE_HIT = "tinyserve.structured_output.cache_hit"
STRUCTURED_OUTPUT_BACKEND = "tinyserve.structured_output.backend"
# The output tokens before the grammar started constraining: 0, or, with a reasoning parser and the reasoning
# open, the reasoning and its </think> (the grammar starts after it, as vLLM's); -1: the reasoning never ended
STRUCTURED_OUTPUT_GRAMMAR_START = "tinyserve.structured_output.grammar_start_token"
# detokenize
DETOKENIZE_CALLS = "tinyserve.detokenize.calls"
DETOKENIZE_TIME = "tinyserve.detokenize.time_s"  # time actually spent detokenizing
STOP_STRING = "tinyserve.stop_string"
# respond
RESPOND_CHUNKS = "tinyserve.respond.chunks"
RESPOND_BYTES = "tinyserve.respond.bytes"
STREAMED = "tinyserve.streamed"
# On the HTTP span: the ORCA load report the response carried (OpenTelemetry's http.response.header.<name>),
# present when the request asked for one (endpoint-load-metrics-format)
HTTP_RESPONSE_ORCA_REPORT = "http.response.header.endpoint-load-metrics"
# step
STEP_ID = "tinyserve.step.id"
STEP_REQUEST_IDS = "tinyserve.step.request_ids"
STEP_TOKENS_PER_REQUEST = "tinyserve.step.num_tokens_per_request"  # aligned with request_ids
STEP_NUM_PREFILL_REQUESTS = "tinyserve.step.num_prefill_requests"
STEP_NUM_DECODE_REQUESTS = "tinyserve.step.num_decode_requests"
STEP_NUM_PREFILL_TOKENS = "tinyserve.step.num_prefill_tokens"
STEP_NUM_DECODE_TOKENS = "tinyserve.step.num_decode_tokens"
STEP_NUM_SCHEDULED_TOKENS = "tinyserve.step.num_scheduled_tokens"
STEP_TOKEN_BUDGET = "tinyserve.step.token_budget"
STEP_PREEMPTED_REQUEST_IDS = "tinyserve.step.preempted_request_ids"
STEP_FINISHED_REQUEST_IDS = "tinyserve.step.finished_request_ids"
# Structured outputs: the scheduled requests whose next token a grammar bitmask constrained, and
# the time spent filling that bitmask (StructuredOutputManager.grammar_bitmask, in the schedule span).
STEP_NUM_CONSTRAINED_REQUESTS = "tinyserve.step.num_constrained_requests"
STEP_GRAMMAR_BITMASK_TIME = "tinyserve.step.grammar_bitmask_time_s"
# The KV blocks each scheduled request gained this step, aligned with request_ids: a count
# per request, the ids flat in one list. A full table (new or resumed request) replaces the
# request's table; otherwise the ids are appended. Released: finished or aborted since the
# previous step, their blocks freed before this one was scheduled. See Run.block_table.
STEP_NUM_NEW_BLOCK_IDS = "tinyserve.step.num_new_block_ids"
STEP_NEW_BLOCK_IDS = "tinyserve.step.new_block_ids"
STEP_BLOCK_TABLE_IS_FULL = "tinyserve.step.block_table_is_full"
STEP_RELEASED_REQUEST_IDS = "tinyserve.step.released_request_ids"
# on tinyserve.execute, on CPU: the forward pass's thread count (engine/worker/cpu_threads.py: fewer
# while other programs take the cores) and the CPU seconds the process used during it
# (threads that own their cores use about cpu_threads CPU seconds per wall second).
EXECUTE_CPU_THREADS = "tinyserve.execute.cpu_threads"
EXECUTE_CPU_TIME = "tinyserve.execute.cpu_time_s"
# on tinyserve.execute, under tensor parallelism: which rank, on what, how long it waited in all-reduces
TP_RANK = "tinyserve.tp.rank"
TP_SIZE = "tinyserve.tp.size"
TP_DEVICE = "tinyserve.tp.device"
TP_ALL_REDUCE_TIME = "tinyserve.tp.all_reduce_time_s"
# on tinyserve.execute, under pipeline parallelism (tinyserve/pipeline_parallel/): the rank's stage, how
# many there are, and how long it waited for the previous stage's hidden states (the span's first part;
# the rest is its layers). The step span then runs from scheduling its batch to the batch's return, so
# the steps of batches in flight together overlap.
PP_STAGE = "tinyserve.pp.stage"
PP_SIZE = "tinyserve.pp.size"
PP_RECV_WAIT_TIME = "tinyserve.pp.recv_wait_time_s"
KV_BLOCKS_USED = "tinyserve.kv.blocks_used"
KV_BLOCKS_FREE = "tinyserve.kv.blocks_free"
KV_BLOCKS_TOTAL = "tinyserve.kv.blocks_total"
KV_USAGE = "tinyserve.kv.usage"
PREFIX_CACHE_HIT_TOKENS = "tinyserve.prefix_cache.hit_tokens"
NUM_WAITING = "tinyserve.num_waiting"
NUM_RUNNING = "tinyserve.num_running"
# LoRA adapters (tinyserve/lora/). A request's adapter: its name on the request span (and the engine's
# queue span); the whole LoRARequest as JSON (lora_name, lora_int_id, lora_path) with the logged inputs
# on tinyserve.render, which replay runs it under. A step's adapters: those of its batch, and those
# of the running and waiting requests after it was scheduled.
LORA_NAME = "tinyserve.lora.name"
LORA_REQUEST = "tinyserve.lora.request"
STEP_LORA_ADAPTERS = "tinyserve.step.lora_adapters"
STEP_RUNNING_LORA_ADAPTERS = "tinyserve.step.running_lora_adapters"
STEP_WAITING_LORA_ADAPTERS = "tinyserve.step.waiting_lora_adapters"
# Prompt embeddings (tinyserve/prompt_embeds/), on the engine's queue span of a request whose prompt came as
# embeddings: its rows (the prompt's tokens) and their width (the model's hidden_size).
PROMPT_EMBEDS_ROWS = "tinyserve.prompt_embeds.rows"
PROMPT_EMBEDS_HIDDEN_SIZE = "tinyserve.prompt_embeds.hidden_size"
# Images (tinyserve/multimodal/). On the engine's queue span of a request with images: each image's content
# hash (mm_hash) and its placeholder run (offset, length; aligned). On a step span whose batch computed
# placeholder positions: the images it encoded, those it found in the encoder cache, and the encoding's
# seconds (inside tinyserve.execute).
MM_HASHES = "tinyserve.mm.hashes"
MM_PLACEHOLDER_OFFSETS = "tinyserve.mm.placeholder_offsets"
MM_PLACEHOLDER_LENGTHS = "tinyserve.mm.placeholder_lengths"
STEP_MM_IMAGES_ENCODED = "tinyserve.step.mm.images_encoded"
STEP_MM_ENCODER_CACHE_HITS = "tinyserve.step.mm.encoder_cache_hits"
STEP_MM_ENCODE_TIME = "tinyserve.step.mm.encode_time"
# The image encoder's own span, inside the step's tinyserve.execute where the step encoded images: how many
# (STEP_MM_IMAGES_ENCODED), their rows (the encoder's output tokens) and their hashes (MM_HASHES)
ENCODE = "tinyserve.encode"
MM_ENCODER_TOKENS = "tinyserve.mm.encoder_tokens"
# Speculative decoding (tinyserve/spec_decode/), on the step span: the requests whose drafts this step
# verified, and for each (aligned) the drafts proposed, accepted and rejected; the seconds the worker
# spent verifying them and proposing the next ones (both inside tinyserve.execute; absent on a step that
# ran no forward pass). The rollback after verifying frees the KV blocks only rejected drafts reached:
# for each verified request (aligned) how many, their ids flat in one list. The request held them while
# this step ran and not after: Run.block_table drops them from the next step's table. (Runs recorded
# before steps logged them have no STEP_SPEC_NUM_FREED_BLOCK_IDS.)
STEP_SPEC_REQUEST_IDS = "tinyserve.step.spec_decode.request_ids"
STEP_SPEC_NUM_PROPOSED = "tinyserve.step.spec_decode.num_proposed"
STEP_SPEC_NUM_ACCEPTED = "tinyserve.step.spec_decode.num_accepted"
STEP_SPEC_NUM_REJECTED = "tinyserve.step.spec_decode.num_rejected"
STEP_SPEC_PROPOSE_TIME = "tinyserve.step.spec_decode.propose_time_s"
STEP_SPEC_VERIFY_TIME = "tinyserve.step.spec_decode.verify_time_s"
STEP_SPEC_NUM_FREED_BLOCK_IDS = "tinyserve.step.spec_decode.num_freed_block_ids"
STEP_SPEC_FREED_BLOCK_IDS = "tinyserve.step.spec_decode.freed_block_ids"
# ... and on a request's tinyserve.decode span: its drafts over its whole life, proposed, accepted, rejected
SPEC_NUM_PROPOSED = "tinyserve.spec_decode.num_proposed"
SPEC_NUM_ACCEPTED = "tinyserve.spec_decode.num_accepted"
SPEC_NUM_REJECTED = "tinyserve.spec_decode.num_rejected"
# Disaggregated prefill (tinyserve/distributed/kv_transfer/): a request's KV transfer, a span in its trace on
# both engines (role "producer": first pull to the consumer's done; "consumer": asking to landed), with the
# connector, the blocks and bytes moved, the seconds it took, and tinyserve.error when it failed. On the
# consumer's tinyserve.prefill span: the prompt tokens whose K/V arrived and were not computed there.
KV_TRANSFER = "tinyserve.kv_transfer"
KV_TRANSFER_ROLE = "tinyserve.kv_transfer.role"
KV_TRANSFER_CONNECTOR = "tinyserve.kv_transfer.connector"
KV_TRANSFER_NUM_BLOCKS = "tinyserve.kv_transfer.num_blocks"
KV_TRANSFER_NUM_BYTES = "tinyserve.kv_transfer.num_bytes"
KV_TRANSFER_TIME = "tinyserve.kv_transfer.time_s"
KV_TRANSFER_NUM_RECEIVED_TOKENS = "tinyserve.kv_transfer.num_received_tokens"

# The router (tinyserve/router/): its span from the choice of a backend to the answer's last byte,
# the parent of the backend's HTTP span (the router sends its context as traceparent).
ROUTE = "tinyserve.route"
ROUTER_POLICY = "tinyserve.router.policy"  # round_robin, least_load, prefix-aware
ROUTER_BACKEND = "tinyserve.router.backend"  # the chosen backend's URL
ROUTER_BACKEND_INDEX = "tinyserve.router.backend_index"  # its place in --backend
ROUTER_REASON = "tinyserve.router.reason"  # the policy's one line on why
ROUTER_BACKEND_IN_FLIGHT = "tinyserve.router.backend_in_flight"  # the router's requests there, before this one
ROUTER_PD_LEG = "tinyserve.router.pd.leg"  # the prefill/decode mode (router/pd.py): "prefill" or "decode"
# prefix-aware: the request's full prompt blocks, and how many leading ones the chosen backend held
# (from its KV events) or was sent already (pending, their events not yet in)
ROUTER_PROMPT_BLOCKS = "tinyserve.router.prompt_blocks"
ROUTER_CACHED_BLOCKS = "tinyserve.router.cached_blocks"
ROUTER_PENDING_BLOCKS = "tinyserve.router.pending_blocks"

# The reasoning parser (tinyserve/reasoning/, --reasoning-parser): a span in the request's trace, made when its
# answer has been read, with the parser's name and per choice (aligned with the choices' indexes) the output
# tokens read as reasoning and the output token count at which the reasoning ended (-1: it never did).
REASONING = "tinyserve.reasoning"
REASONING_PARSER = "tinyserve.reasoning.parser"
REASONING_NUM_TOKENS = "tinyserve.reasoning.num_tokens"
REASONING_ENDED_AT = "tinyserve.reasoning.ended_at_token"

# KV cache events (tinyserve/kv_events/), on the step span: the events published after the step
# (BlockStored, BlockRemoved, AllBlocksCleared; a BlockStored may hold several blocks)
STEP_KV_EVENTS = "tinyserve.step.kv_events"

# ---- trace files -------------------------------------------------------------------
MANIFEST_FILE = "manifest.json"
API_TRACE_FILE = "api.jsonl"
ROUTER_TRACE_FILE = "router.jsonl"
RUN_IMAGES_DIR = "images"  # the images the run's requests carried, one <mm_hash>.<format> each (multimodal/)


def api_trace_file(rank: int | None) -> str:
    """api.jsonl; in a run merged from several ranks' servers (external load balancing), api-<rank>.jsonl;
    API process i of several (--api-server-count) writes api-<i>.jsonl."""
    return API_TRACE_FILE if rank is None else f"api-{rank}.jsonl"


OFFLINE_TRACE_FILE = "offline.jsonl"


def engine_trace_file(engine_index: int) -> str:
    return f"engine-{engine_index}.jsonl"


# Under --trace-max-mb a process writes its step spans to numbered segments beside its file
# (otlp_capped.py), and the manifest counts what was dropped under this key.
STEP_SPANS = (STEP, SCHEDULE, EXECUTE, UPDATE)
TIMELINE_SPANS = (*STEP_SPANS, ENGINE_TIMELINE)  # what a capped folder keeps in its step segments
MANIFEST_DROPPED = "dropped"
# The machine a run folder came from ({"host", "headless", "ranks"}); `trace merge` joins
# the folders of several nodes and lists theirs under MANIFEST_NODES.
MANIFEST_NODE = "node"
MANIFEST_NODES = "nodes"


def step_segment_file(trace_file: str, number: int) -> str:
    """engine-0.jsonl, 3 -> engine-0.steps-000003.jsonl"""
    return f"{trace_file.removesuffix('.jsonl')}.steps-{number:06d}.jsonl"
