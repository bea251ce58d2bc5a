"""The worker's own record of each request it serves, kept from one step to the next.

The worker reads nothing but each step's SchedulerOutput (scheduler_output.py): it
may run in another process than the scheduler, one per GPU under tensor
parallelism, where the scheduler's Request objects do not exist. It learns a
request once, in full (NewRequestData), and keeps it current from then on:

    NewRequestData ──► CachedRequestState(prompt, outputs=[], block table [4, 9])
    each step          + new_block_ids of its CachedRequestData; + the token it sampled
    preempted          block table dropped (the blocks were freed); the rest is kept
    resumed            NewRequestData again: outputs and block table replaced;
                       its seeded generator and reported prompt logprobs carry on
    finished/aborted   forgotten
"""

from dataclasses import dataclass, field

import torch

from tinyserve.lora_request import LoRARequest
from tinyserve.sampling_params import SamplingParams
from tinyserve.wire.messages import MultiModalFeature, PromptEmbeds


@dataclass(slots=True, eq=False)
class CachedRequestState:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)  # as sampled here, step by step
    block_ids: list[int] = field(default_factory=list)  # empty while preempted
    # A seeded request draws from its own generator, made at its first random draw; it
    # lives as long as the request, preemptions included, so its tokens do not change.
    generator: torch.Generator | None = None
    num_prompt_logprobs: int = 0  # prompt positions whose logprobs were reported (prompt_logprobs)
    # allowed_token_ids as a mask over the vocabulary (True: forbidden), made at its first step (token_filters.py)
    allowed_token_ids_mask: torch.Tensor | None = None
    lora_request: LoRARequest | None = None  # its adapter (tinyserve/lora/manager.py reads it)
    # Speculative decoding: this step's drafts, fed after the known tokens (SchedulerOutput.scheduled_spec_decode_tokens)
    spec_token_ids: list[int] = field(default_factory=list)
    prompt_embeds: PromptEmbeds | None = None  # its prompt as embeddings (tinyserve/prompt_embeds/ reads them)
    mm_features: list[MultiModalFeature] | None = None  # its images (tinyserve/multimodal/ reads them)

    @classmethod
    def of(cls, new) -> "CachedRequestState":
        """A request scheduled for the first time (a NewRequestData): what the worker keeps of it."""
        return cls(new.request_id, new.prompt_token_ids, new.sampling_params, new.eos_token_ids,
                   lora_request=new.lora_request, prompt_embeds=new.prompt_embeds, mm_features=new.mm_features)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def min_tokens_stop_ids(self) -> set[int]:
        """What min_tokens masks: every stop token, EOS even under ignore_eos (vLLM's all stop token ids)."""
        return set(self.sampling_params.stop_token_ids or ()).union(self.eos_token_ids)

    def token_ids(self, start: int, end: int) -> list[int]:
        """The token ids at positions [start, end) of prompt + output (+ this step's drafts)."""
        num_prompt = len(self.prompt_token_ids)
        output_start, output_end = max(start - num_prompt, 0), max(end - num_prompt, 0)
        token_ids = self.prompt_token_ids[start:end] + self.output_token_ids[output_start:output_end]
        if self.spec_token_ids:
            num_known = num_prompt + len(self.output_token_ids)
            token_ids += self.spec_token_ids[max(start - num_known, 0):max(end - num_known, 0)]
        return token_ids
