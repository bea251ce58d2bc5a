"""What the engine's layers add to `trace request` and `trace step` (views.py), read from the run's spans.

    adapter_of        a request's LoRA adapter ("base model" in a LoRA run, None without LoRA)
    prompt_kv         where a prompt's K/V came from: the prefix cache, or a transfer from the
                      prefill server (disaggregated prefill: they are not the prefix cache's)
    received_tokens   the prompt tokens whose K/V arrived by transfer
    speculation       one request's drafts in one step: drafted, accepted, emitted, rollback frees
    step_speculation  a speculative step's drafts all told, and its verify / propose times

NOT_RECORDED stands where a run was recorded before the spans held what a view needs.
"""

import weakref

from tinyserve.lifecycle import schema
from tinyserve.trace_reading.run import Run
from tinyserve.trace_reading.timeline import RequestTimeline, SequenceTimeline

NOT_RECORDED = "not recorded in this run"


def ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1e3, 3)


def adapter_of(run: Run, timeline: RequestTimeline) -> str | None:
    """The LoRA adapter the request ran under; "base model" for one without, in a run with adapters;
    None in a run without LoRA."""
    name = timeline.request_span.attributes.get(schema.LORA_NAME)
    if name is None:
        name = (timeline.inputs.lora_request or {}).get("lora_name")
    if name is None:
        name = next((q.attributes[schema.LORA_NAME] for s in timeline.sequences
                     if (q := s.queue) is not None and schema.LORA_NAME in q.attributes), None)
    if name is not None:
        return str(name)
    return "base model" if run.manifest.get("engine_args", {}).get("enable_lora") else None


def prompt_kv(run: Run, timeline: RequestTimeline, sequence: SequenceTimeline) -> dict:
    """Where the prompt's K/V came from, besides computing it: the prefix cache, or (the decode server of
    a disaggregated pair) a transfer from the prefill server, with that transfer's span."""
    received = received_tokens(sequence)
    cached = sequence.num_cached_tokens
    transfers = [s for s in _transfers(run).get(timeline.trace_id, [])
                 if str(s.attributes.get(schema.REQUEST_ID, sequence.request_id)) == sequence.request_id]
    return {
        # cached tokens are the prefix cache's and the transfer's together: the prefix cache's are the rest
        "num_prefix_cache_tokens": None if cached is None else cached - (received or 0),
        "num_received_tokens": received,
        "kv_transfers": [{"role": t.attributes.get(schema.KV_TRANSFER_ROLE),
                          "connector": t.attributes.get(schema.KV_TRANSFER_CONNECTOR),
                          "num_blocks": t.attributes.get(schema.KV_TRANSFER_NUM_BLOCKS),
                          "num_bytes": t.attributes.get(schema.KV_TRANSFER_NUM_BYTES),
                          "duration_ms": ms(t.duration_s), "error": t.attributes.get(schema.ERROR_REASON)}
                         for t in transfers],
    }


def received_tokens(sequence: SequenceTimeline) -> int | None:
    """The prompt tokens whose K/V arrived from a prefill server (on the decode server's prefill span)."""
    prefill = sequence.prefill
    return prefill.attributes.get(schema.KV_TRANSFER_NUM_RECEIVED_TOKENS) if prefill else None


_TRANSFERS: "weakref.WeakKeyDictionary[Run, dict]" = weakref.WeakKeyDictionary()


def _transfers(run: Run) -> dict[str, list]:
    """The run's KV transfer spans by trace id (found once per run: a step view asks for each request)."""
    if run not in _TRANSFERS:
        found: dict[str, list] = {}
        for span in run.spans:
            if span.name == schema.KV_TRANSFER:
                found.setdefault(span.trace_id, []).append(span)
        _TRANSFERS[run] = found
    return _TRANSFERS[run]


def speculation(step, request_id: str, emitted: int) -> dict:
    """A request's drafts in one step: proposed (verified here), accepted, the tokens the step emitted (its
    token times inside the step: a stop may end it before all accepted ones), the blocks its rollback freed."""
    proposed, accepted = step.drafts[request_id]
    freed = step.rollback_freed_block_ids
    return {"drafted": proposed, "accepted": accepted, "emitted": emitted,
            "rollback_freed_block_ids": NOT_RECORDED if freed is None else freed.get(request_id, [])}


def step_speculation(run: Run, step) -> dict | None:
    """A speculative step's drafts all told, and the worker's time verifying and proposing (None: not a
    speculative run). A step that ran no forward pass has no such time: runs recorded before that was fixed
    carry the previous step's there, which is not shown."""
    if not run.is_speculative:
        return None
    attributes = step.span.attributes
    ran = bool(step.request_ids)
    return {"drafted": sum(p for p, _ in step.drafts.values()), "accepted": sum(n for _, n in step.drafts.values()),
            "verify_ms": ms(attributes.get(schema.STEP_SPEC_VERIFY_TIME)) if ran else None,
            "propose_ms": ms(attributes.get(schema.STEP_SPEC_PROPOSE_TIME)) if ran else None,
            "rollback_frees_recorded": step.rollback_freed_block_ids is not None}
