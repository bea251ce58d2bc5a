"""The model runner's side of prompt embeddings: the rows a prompt came as, in place of the lookup.

The runner flattens a step's batch (engine/worker/model_runner.py); a request whose prompt came as
embeddings has placeholder ids at its prompt positions. This hook, one of the runner's embeds_hooks,
looks the whole batch up as usual and then overwrites those positions' rows with the request's own:

    batch:          A (embeds prompt, rows 0-3)   B (decode)   A' (embeds, chunk of rows 4-5)
    input_ids:      0  0  0  0                    b9           0  0
    inputs_embeds:  a0 a1 a2 a3                   E[b9]        a4 a5       (E: embed_tokens)

Positions past the prompt (the tokens it samples) are ordinary tokens, looked up as any other.
A batch without such a request returns the rows it was handed (None: the model looks input_ids up itself).
"""

import torch

from tinyserve.prompt_embeds.tensors import as_tensor


class PromptEmbedsInputs:
    def __init__(self, model) -> None:
        self.model = model

    def __call__(self, scheduled_requests, states, input_ids: torch.Tensor,
                 rows: torch.Tensor | None) -> torch.Tensor | None:
        pieces, flat = [], 0  # pieces: (flat index of the first row, prompt positions [start, end), the rows)
        for scheduled, state in zip(scheduled_requests, states):
            embeds = state.prompt_embeds
            start = scheduled.num_computed_tokens
            if embeds is not None and start < embeds.rows:
                pieces.append((flat, start, min(start + scheduled.num_new_tokens, embeds.rows), embeds))
            flat += scheduled.num_new_tokens
        if not pieces:
            return rows
        if rows is None:
            rows = self.model.embed_tokens(input_ids)
        for flat, start, end, embeds in pieces:
            rows[flat:flat + end - start] = as_tensor(embeds)[start:end].to(rows.device, rows.dtype)
        return rows
