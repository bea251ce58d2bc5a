"""The model runner: turn a SchedulerOutput into one forward pass and sampled tokens.

The scheduled requests are flattened into one batch with no padding:

    request:        A (prefill chunk, 4 tokens)   B (decode)   C (prefill, 3 tokens)
    input_ids:      a4 a5 a6 a7                   b9           c0 c1 c2
    positions:      4  5  6  7                    9            0  1  2
    slot_mapping:   where each token's K/V goes: block_table[pos // bs] * bs + pos % bs
    query_start_loc 0                             4            5          8
    seq_lens:       8                             10           3

Logits are computed only at the last position of each request that reaches the
end of its known tokens this step (A's chunk might not; B and C do).

The SchedulerOutput is all the runner reads: a worker may run in another process
than the scheduler (tensor parallelism: one per GPU), where the scheduler's
Request objects do not exist. So it keeps its own state per request
(request_state.py): learned in full when a request is new, updated from each
step's deltas, and extended with the tokens it samples itself; a cached request's
input ids (B's b9 above) come from there.
"""

from dataclasses import dataclass, field

import torch

from tinyserve.engine.core.scheduler_output import NewRequestData, SchedulerOutput
from tinyserve.engine.worker.cpu_memory import keep_freed_memory
from tinyserve.engine.worker.cuda_graphs import DecodeGraphs
from tinyserve.engine.worker.request_state import CachedRequestState
from tinyserve.engine.worker.sampler import Sampler, top_logprobs
from tinyserve.kernels.metadata import AttentionMetadata
from tinyserve.sampling_params import SamplingParams
from tinyserve.wire.messages import TokenLogprobs


@dataclass(slots=True)
class ModelRunnerOutput:
    # Each sampling request's new tokens: one; or, verifying speculative drafts (spec_decode/), the
    # accepted drafts and one more. logprobs: one TokenLogprobs per new token, for requests that asked.
    sampled_token_ids: dict[str, list[int]]
    logprobs: dict[str, list[TokenLogprobs]]
    prompt_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    # --runner pooling: the vector of each request whose prompt this step finished (pooling_runner.py)
    pooler_output: dict[str, list[float]] = field(default_factory=dict)
    # Speculative decoding: each request's drafts for the next step (vLLM's spec_token_ids)
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # A KV connector (distributed/kv_transfer/): the sends and receives that completed (vLLM's KVConnectorOutput)
    kv_connector_output: object = None


@dataclass(slots=True)
class ModelInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    metadata: AttentionMetadata
    logits_indices: torch.Tensor  # flat index of the last token of each sampling request
    sampling_request_ids: list[str]
    # [num_tokens, hidden_size]: what the model reads in place of its embedding lookup, or None (it looks
    # input_ids up): the layers' rows for the batch (prompt embeddings, images)
    inputs_embeds: torch.Tensor | None = None


class ModelRunner:
    def __init__(self, model, *, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device,
                 seed: int = 0, decode_graphs: bool = False, max_num_seqs: int = 256, max_model_len: int = 2048):
        self.model = model
        self.block_size = block_size
        self.device = device
        if device.type == "cpu":
            keep_freed_memory()  # a step's large activations reuse the last step's memory (cpu_memory.py)
        # One pool per layer: [2 (K, V), num_blocks, block_size, num_kv_heads, head_dim].
        shape = (2, num_blocks, block_size, model.num_kv_heads, model.head_dim)
        self.kv_caches = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(model.num_layers)]
        self.sampler = Sampler(device, seed)
        self.requests: dict[str, CachedRequestState] = {}  # every request between first scheduled and finished
        # Decode-only steps through static buffers, recorded as CUDA graphs on a GPU
        # (cuda_graphs.py); on a CPU the same buffers run eagerly.
        self.decode_graphs = DecodeGraphs(
            model, self.kv_caches, max_num_seqs=max_num_seqs, max_model_len=max_model_len, block_size=block_size,
            device=device, capture=device.type == "cuda",
        ) if decode_graphs else None
        self.num_graph_steps = 0  # decode steps that ran through decode_graphs
        # Layers beside the model that must see each batch as it is flattened (LoRA: lora/manager.py),
        # each hook(scheduled requests, their states), called at the end of prepare_inputs.
        self.input_hooks: list = []
        # Layers that give some positions' input rows themselves (prompt embeddings: tinyserve/prompt_embeds/;
        # images: tinyserve/multimodal/): each hook(scheduled requests, their states, input_ids on the device,
        # the rows so far or None) -> the rows (ModelInputs.inputs_embeds; None: the model looks input_ids up).
        # A hook with rows to write looks the batch up first if no hook before it did, then writes its own.
        self.embeds_hooks: list = []

    @staticmethod
    def kv_bytes_per_block(model, block_size: int, dtype: torch.dtype) -> int:
        element = torch.empty((), dtype=dtype).element_size()
        return 2 * model.num_layers * block_size * model.num_kv_heads * model.head_dim * element

    def update_states(self, scheduler_output: SchedulerOutput) -> None:
        """Bring the per-request state up to date with what the scheduler decided for this step.

        Finished ids first: a request id may be used again by a new request in the same step.
        """
        for request_id in scheduler_output.finished_request_ids:
            self.requests.pop(request_id, None)  # an aborted request may never have been scheduled
        for request_id in scheduler_output.preempted_request_ids:
            self.requests[request_id].block_ids = []
        for new in scheduler_output.scheduled_new_requests:
            state = self.requests.get(new.request_id)
            if state is None:
                state = CachedRequestState.of(new)
                self.requests[new.request_id] = state
            state.output_token_ids = list(new.output_token_ids)  # empty, unless resumed after a preemption
            state.block_ids = list(new.block_ids)
        for cached in scheduler_output.scheduled_cached_requests:
            self.requests[cached.request_id].block_ids += cached.new_block_ids

    def prepare_inputs(self, scheduler_output: SchedulerOutput) -> ModelInputs:
        """Flatten the step's batch (after update_states: block tables and token ids come from the state)."""
        bs = self.block_size
        scheduled_requests = scheduler_output.scheduled
        states = [self.requests[scheduled.request_id] for scheduled in scheduled_requests]
        input_ids, positions, slot_mapping = [], [], []
        query_lens, seq_lens, logits_indices, sampling_ids = [], [], [], []
        for scheduled, state in zip(scheduled_requests, states):
            start = scheduled.num_computed_tokens
            end = start + scheduled.num_new_tokens
            blocks = state.block_ids
            input_ids += state.token_ids(start, end)
            positions += range(start, end)
            slot_mapping += [blocks[pos // bs] * bs + pos % bs for pos in range(start, end)]
            query_lens.append(scheduled.num_new_tokens)
            seq_lens.append(end)
            if scheduled.samples_token:
                logits_indices.append(len(input_ids) - 1)
                sampling_ids.append(scheduled.request_id)

        max_blocks = max(len(state.block_ids) for state in states)
        # One tensor from the padded rows, not one per request copied in (128 small ops for 64 decodes).
        block_tables = torch.tensor([state.block_ids + [0] * (max_blocks - len(state.block_ids)) for state in states],
                                    dtype=torch.int32)

        def on_device(values, dtype):
            return torch.tensor(values, dtype=dtype).to(self.device, non_blocking=True)

        metadata = AttentionMetadata.from_lengths(
            query_lens, seq_lens, block_tables.to(self.device, non_blocking=True),
            torch.tensor(slot_mapping, dtype=torch.int64),
        )
        for hook in self.input_hooks:
            hook(scheduled_requests, states)
        input_ids = on_device(input_ids, torch.int64)
        inputs_embeds = None
        for hook in self.embeds_hooks:
            inputs_embeds = hook(scheduled_requests, states, input_ids, inputs_embeds)
        return ModelInputs(
            input_ids=input_ids,
            positions=on_device(positions, torch.int64),
            metadata=metadata,
            logits_indices=on_device(logits_indices, torch.int64),
            sampling_request_ids=sampling_ids,
            inputs_embeds=inputs_embeds,
        )

    def warm_up_step(self) -> SchedulerOutput:
        """The warm-up's one step: a dummy prompt of one block, in block 0 (see warm_up)."""
        dummy = NewRequestData("warm-up", 0, self.block_size, samples_token=True, is_prefill=True,
                               prompt_token_ids=[0] * self.block_size, sampling_params=SamplingParams(),
                               eos_token_ids=[], block_ids=[0], output_token_ids=[])
        return SchedulerOutput(step_id=0, scheduled_new_requests=[dummy])

    @torch.inference_mode()
    def warm_up(self) -> None:
        """One forward pass over a dummy prompt, so the first real request does not pay the
        one-time costs (memory allocation, kernel selection, Triton compilation on a GPU).

        It writes K/V only into block 0, which is free: whichever request gets block 0
        later writes its own tokens there before anything reads them. The dummy request
        comes and goes as a real one would: new in one SchedulerOutput, finished in the next.
        """
        scheduler_output = self.warm_up_step()
        dummy = scheduler_output.scheduled_new_requests[0]
        self.update_states(scheduler_output)
        inputs = self.prepare_inputs(scheduler_output)
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.metadata)
        self.model.compute_logits(hidden[inputs.logits_indices])
        self.update_states(SchedulerOutput(step_id=0, finished_request_ids=[dummy.request_id]))
        if self.decode_graphs is not None:
            self.decode_graphs.capture_all()

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self.update_states(scheduler_output)
        if scheduler_output.is_empty:
            return ModelRunnerOutput({}, {})
        inputs = self.prepare_inputs(scheduler_output)
        hidden = self._forward(inputs)
        return self._outputs(hidden, inputs, scheduler_output)

    def _outputs(self, hidden: torch.Tensor, inputs: ModelInputs,
                 scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """What the step hands back from its hidden states: the next token of each request that reached
        the end of its known tokens, sampled from the logits there (and prompt logprobs where asked).

        The pooling runner (pooling_runner.py) pools the hidden states here instead.
        """
        sampled, logprobs = {}, {}
        if inputs.sampling_request_ids:
            logits = self.model.compute_logits(hidden[inputs.logits_indices])
            sampling_states = [self.requests[request_id] for request_id in inputs.sampling_request_ids]
            rows = {request_id: row for row, request_id in enumerate(inputs.sampling_request_ids)}
            grammar_rows = [rows[request_id] for request_id in scheduler_output.structured_output_request_ids]
            token_ids, token_logprobs = self.sampler.sample(logits, sampling_states,
                                                            scheduler_output.grammar_bitmask, grammar_rows)
            for state, token_id in zip(sampling_states, token_ids):
                state.output_token_ids.append(token_id)  # the scheduler appends the same token to its Request
            sampled = {rid: [token_id] for rid, token_id in zip(inputs.sampling_request_ids, token_ids)}
            logprobs = {rid: [lp] for rid, lp in zip(inputs.sampling_request_ids, token_logprobs) if lp is not None}
        prompt_logprobs = self._prompt_logprobs(hidden, scheduler_output)
        return ModelRunnerOutput(sampled, logprobs, prompt_logprobs)

    def _prompt_logprobs(self, hidden: torch.Tensor,
                         scheduler_output: SchedulerOutput) -> dict[str, list[TokenLogprobs]]:
        """For requests that asked (prompt_logprobs), the logprobs of the prompt tokens this step predicts.

        The hidden state at prompt position p predicts prompt token p + 1; the last prompt
        position predicts the first output token instead, which the sampler reports. A
        request recomputed after a preemption does not get the positions it already has.
        """
        result = {}
        first_row = 0
        for scheduled in scheduler_output.scheduled:
            rows_start, first_row = first_row, first_row + scheduled.num_new_tokens
            state = self.requests[scheduled.request_id]
            if state.sampling_params.prompt_logprobs is None:
                continue
            prompt, computed = state.prompt_token_ids, scheduled.num_computed_tokens
            start = max(computed, state.num_prompt_logprobs)
            end = min(computed + scheduled.num_new_tokens, len(prompt) - 1)
            if start >= end:
                continue
            rows = hidden[rows_start + start - computed : rows_start + end - computed]
            logprobs = torch.log_softmax(self.model.compute_logits(rows).float(), dim=-1)
            num_top = state.sampling_params.prompt_logprobs
            result[state.request_id] = [top_logprobs(logprobs[i], prompt[position + 1], num_top)
                                        for i, position in enumerate(range(start, end))]
            state.num_prompt_logprobs = end
        return result

    def _forward(self, inputs: ModelInputs) -> torch.Tensor:
        """The model over the batch: a decode step's recorded graph where one fits (the graphs look token ids
        up themselves, so not with a layer's rows), else the model itself."""
        graphs = self.decode_graphs
        if (graphs is not None and inputs.metadata.is_decode_only and inputs.inputs_embeds is None
                and graphs.bucket_for(inputs.metadata.num_seqs) is not None):
            self.num_graph_steps += 1
            return graphs.run(inputs.input_ids, inputs.positions, inputs.metadata)
        return self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.metadata,
                          inputs_embeds=inputs.inputs_embeds)
