"""One request, or one engine step, of a traced run: what `tinyserve trace request` and `trace step` print.

    request_view(run, ID)     the request's span tree across processes; its stage durations and
                              how its TTFT splits into them; for each completion, the engine
                              steps that served it (tokens, prefill or decode, batch mates), its
                              block table as it grew, its preemptions; its logged inputs and outputs
    step_view(run, N)         one engine step: each request's tokens (prefill, decode or
                              recompute), the KV blocks allocated and released, the schedule /
                              execute / update times, and where recorded, the tensor-parallel
                              ranks and the grammar bitmask's time

Both know the engine's layers, from what the run recorded: each request's LoRA adapter; the
KV that reached a decode server by transfer (not from its prefix cache); speculative steps
(positions computed = the newest token + its drafts; drafts accepted; tokens emitted, read
from the request's token times; the blocks each rollback freed, and the block tables without
them); pipeline stages (each stage's wait for its input and its compute). Where a run lacks
an attribute a view needs (recorded before it was), the view says so rather than guess.

Both return plain dicts (`--json` prints them); views_text.py makes them text. Everything is read from the run's spans (run.py): nothing here is recorded anew.

What a step was for a request is read from the request's own token times: a step that
sampled one of its tokens (a token time inside the step) after the first is a decode; the
steps before its first token are its prefill (a chunk each, with chunked prefill); after a
preemption, the steps that compute again what it had are a recompute, the last of them
sampling its next token.
"""

from tinyserve.lifecycle import schema
from tinyserve.trace_reading.otlp_json import Span
from tinyserve.trace_reading.run import Run
from tinyserve.trace_reading.timeline import SEQUENCE_STAGES, RequestTimeline, SequenceTimeline
from tinyserve.trace_reading.ttft import ttft_breakdown as ttft_pieces
from tinyserve.trace_reading.views_layers import (
    NOT_RECORDED,
    adapter_of,
    ms,
    prompt_kv,
    received_tokens,
    speculation,
    step_speculation,
)

_ms = ms  # milliseconds, to the microsecond


# ---- one request ------------------------------------------------------------------------


def request_view(run: Run, request_id: str) -> dict:
    """Everything the run recorded of one request (its client id, or an engine request id)."""
    timeline = run.request(request_id)
    origin = timeline.arrival_ns
    return {
        "request_id": timeline.request_id,
        "operation": timeline.operation,
        "model": timeline.model,
        "trace_id": timeline.trace_id,
        "error": timeline.error,
        "finish_reasons": timeline.finish_reasons,
        "num_prompt_tokens": timeline.num_prompt_tokens,
        "num_output_tokens": timeline.num_output_tokens,
        "adapter": adapter_of(run, timeline),
        "latency_ms": {"ttft": _ms(timeline.ttft_s), "tpot": _ms(timeline.tpot_s), "e2e": _ms(timeline.e2e_s)},
        "ttft_breakdown_ms": ttft_breakdown(timeline),
        "span_tree": span_tree(run, timeline.trace_id, origin),
        "sequences": [sequence_view(run, timeline, sequence) for sequence in timeline.sequences],
        "inputs": {"messages": timeline.inputs.messages, "prompt": timeline.inputs.prompt,
                   "prompt_token_ids": timeline.inputs.prompt_token_ids,
                   "sampling_params": timeline.inputs.sampling_params, "redacted": timeline.inputs.redacted,
                   "pooling_params": timeline.inputs.pooling_params, "images": images_of(timeline)},
        "completions": [{"index": c.index, "text": c.text, "token_ids": c.token_ids,
                         "finish_reason": c.finish_reason} for c in timeline.completions],
    }


def images_of(timeline: RequestTimeline) -> list[dict]:
    """The request's images as its render span logged them: content hash and placeholder run, in prompt order."""
    inputs = timeline.inputs
    return [{"mm_hash": h, "offset": offset, "length": length}
            for h, (offset, length) in zip(inputs.mm_hashes or (), inputs.mm_placeholders or ())]


def ttft_breakdown(timeline: RequestTimeline) -> dict:
    """Arrival → first token in milliseconds, cut into consecutive pieces (ttft.py: the same pieces
    chapter 1 prints), each ≥ 0 and adding up to "ttft"; {} when no token came."""
    pieces = ttft_pieces(timeline)
    if not pieces:
        return {}
    return {**{name: _ms(seconds) for name, seconds in pieces.items()}, "ttft": _ms(timeline.ttft_s)}


def span_tree(run: Run, trace_id: str, origin_ns: int) -> list[dict]:
    """The trace's spans as a tree (parents before children, by start), each with its process and host."""
    spans = [s for s in run.spans if s.trace_id == trace_id]
    ids = {s.span_id for s in spans}
    children: dict[str | None, list[Span]] = {}
    for span in spans:
        parent = span.parent_span_id if span.parent_span_id in ids else None
        children.setdefault(parent, []).append(span)
    rows = []

    def visit(parent: str | None, depth: int) -> None:
        for span in sorted(children.get(parent, []), key=lambda s: s.start_ns):
            rows.append({"depth": depth, "name": span.name, "service": span.service,
                         "host": span.resource.get(schema.RESOURCE_HOST),
                         "start_ms": _ms((span.start_ns - origin_ns) / 1e9), "duration_ms": _ms(span.duration_s)})
            visit(span.span_id, depth + 1)

    visit(None, 0)
    return rows


def sequence_view(run: Run, timeline: RequestTimeline, sequence: SequenceTimeline) -> dict:
    """One completion's engine request: its stages, the steps that served it, its block table over time."""
    steps = served_steps(run, timeline, sequence)
    tables = []
    note = None
    if run.is_speculative and run.has_block_tables and not run.rollback_frees_recorded:
        note = (f"the blocks freed by draft rollbacks are {NOT_RECORDED}: after a step that rejected drafts, "
                "a table may still list a block the rollback freed")
    if run.has_block_tables and sequence.engine_index is not None:
        previous = None
        for row in steps:
            table = run.block_table(sequence.request_id, row["step_id"], sequence.engine_index)
            if table is not None and table != previous:
                tables.append({"step_id": row["step_id"], "block_ids": table})
                previous = table
    return {
        "request_id": sequence.request_id,
        "engine_index": sequence.engine_index,
        "seed": sequence.seed,
        "stages_ms": {name.removeprefix("tinyserve."): _ms(sequence.stages[name].duration_s)
                      for name in SEQUENCE_STAGES if name in sequence.stages},
        "num_cached_tokens": sequence.num_cached_tokens,
        **prompt_kv(run, timeline, sequence),
        "num_output_tokens": sequence.num_output_tokens,
        "num_preemptions": sequence.num_preemptions,
        "steps": steps,
        "block_table_growth": tables,
        "block_table_note": note,
    }


def served_steps(run: Run, timeline: RequestTimeline, sequence: SequenceTimeline) -> list[dict]:
    """The steps of `sequence`'s engine that scheduled it (or preempted it), in order, each labelled."""
    request_id = sequence.request_id
    token_times = sequence.token_times_ns
    rows, sampled_before, recomputing = [], 0, False
    for step in sorted(run.engine_steps(sequence.engine_index), key=lambda s: s.step_id):
        if request_id in step.preempted_request_ids:
            rows.append({"step_id": step.step_id, "kind": "preempted", "tokens": 0, "batch_mates": []})
            recomputing = True
            continue
        if request_id not in step.request_ids:
            continue
        sampled = sum(1 for t in token_times if step.start_ns <= t <= step.end_ns)
        if sampled and sampled_before and not recomputing:
            kind = "decode"
        else:
            kind = "recompute" if recomputing else "prefill"
        if sampled:
            recomputing = False
        sampled_before += sampled
        tokens = step.num_tokens_per_request[step.request_ids.index(request_id)]
        row = {"step_id": step.step_id, "kind": kind, "tokens": tokens, "sampled": bool(sampled),
               "batch_mates": [r for r in step.request_ids if r != request_id]}
        if request_id in step.drafts:  # a speculative step: `tokens` positions computed, not tokens out
            row.update(speculation(step, request_id, sampled))
        rows.append(row)
    return rows


# ---- one step ---------------------------------------------------------------------------


def step_view(run: Run, step_id: int, engine_index: int | None = None) -> dict:
    """Step `step_id` of one engine (the only one, unless `engine_index` names it)."""
    engines = run.engine_indices
    if engine_index is None:
        if len(engines) > 1:
            raise ValueError(f"run {run.name} has engines {engines}: say which with --engine")
        engine_index = engines[0] if engines else None
    matches = [s for s in run.engine_steps(engine_index) if s.step_id == step_id]
    if not matches:
        ids = [s.step_id for s in run.engine_steps(engine_index)]
        span = f"{min(ids)}..{max(ids)}" if ids else "none"
        raise ValueError(f"engine {engine_index} of run {run.name} has no step {step_id} (its steps: {span})")
    step = matches[0]
    labels, about = _labels_in_step(run, step)
    released, preempted = _freed_blocks(run, step) if run.has_block_tables else ({}, {})
    staged = [r for r in step.ranks if "stage" in r]
    return {
        "step_id": step.step_id,
        "engine_index": step.engine_index,
        "start_ms": _ms((step.start_ns - run.origin_ns) / 1e9),
        "duration_ms": _ms(step.duration_s),
        "phases_ms": {"schedule": _ms(step.schedule_s), "execute": _ms(step.execute_s), "update": _ms(step.update_s)},
        "batch": [{"request_id": request_id, "tokens": tokens, "kind": labels.get(request_id),
                   "new_block_ids": new_ids, **about.get(request_id, {})}
                  for request_id, tokens, new_ids in zip(step.request_ids, step.num_tokens_per_request,
                                                         step.new_block_ids or [[]] * len(step.request_ids))],
        "num_prefill_tokens": step.num_prefill_tokens,
        "num_decode_tokens": step.num_decode_tokens,
        "token_budget": step.token_budget,
        "kv_blocks": {"used": step.kv_blocks_used, "free": step.kv_blocks_free, "total": step.kv_blocks_total,
                      "allocated": sum(len(ids) for ids in step.new_block_ids), "released": released,
                      "freed_by_preemption": preempted},
        "prefix_cache_hit_tokens": step.prefix_cache_hit_tokens,
        "num_waiting": step.num_waiting,
        "num_running": step.num_running,
        "preempted_request_ids": step.preempted_request_ids,
        "finished_request_ids": step.finished_request_ids,
        "tensor_parallel_ranks": [{"rank": r["rank"], "device": r["device"], "execute_ms": _ms(r["execute_s"]),
                                   "all_reduce_ms": _ms(r["all_reduce_s"])} for r in step.ranks if "stage" not in r],
        # Pipeline parallelism: each stage's rank, from when (since the step began), its wait for the hidden
        # states of the stage before (or, for a stage whose input was ready, none) and its own compute
        "pipeline_stages": [{"stage": r["stage"], "rank": r["rank"], "device": r["device"],
                             "start_ms": _ms((r["start_ns"] - step.start_ns) / 1e9), "execute_ms": _ms(r["execute_s"]),
                             "recv_wait_ms": _ms(r["recv_wait_s"]),
                             "compute_ms": _ms(r["execute_s"] - r["recv_wait_s"]),
                             "all_reduce_ms": _ms(r["all_reduce_s"])} for r in staged],
        "speculative": step_speculation(run, step),
        # a step without constrained requests that sample has no bitmask (its time is absent or 0)
        "grammar_bitmask_ms": _ms(step.span.attributes.get(schema.STEP_GRAMMAR_BITMASK_TIME)) or None,
        # a step that computed image placeholders: the images it encoded (tinyserve.encode), and those it found in
        # the encoder cache; None for any other step
        "images": {"encoded": step.span.attributes.get(schema.STEP_MM_IMAGES_ENCODED, 0),
                   "encoder_cache_hits": step.span.attributes.get(schema.STEP_MM_ENCODER_CACHE_HITS, 0),
                   "encode_ms": _ms(step.span.attributes.get(schema.STEP_MM_ENCODE_TIME, 0.0))}
        if schema.STEP_MM_IMAGES_ENCODED in step.span.attributes else None,
    }


def _labels_in_step(run: Run, step) -> tuple[dict[str, str], dict[str, dict]]:
    """Each scheduled request's kind of work in this step (prefill, decode, recompute), from its own steps;
    and what its layers add to its row: its adapter, its drafts, the KV it received by transfer."""
    labels, about = {}, {}
    for request_id in step.request_ids:
        try:
            timeline = run.request(request_id)
        except ValueError:  # its request span is not in the run (a capped run dropped it)
            continue
        sequence = next(s for s in timeline.sequences if s.request_id == request_id)
        rows = served_steps(run, timeline, sequence)
        extra = about.setdefault(request_id, {})
        adapter = adapter_of(run, timeline)
        if adapter is not None:
            extra["adapter"] = adapter
        for row in rows:
            if row["step_id"] == step.step_id:
                labels[request_id] = row["kind"]
                extra.update({k: row[k] for k in ("drafted", "accepted", "emitted", "rollback_freed_block_ids")
                              if k in row})
        received = received_tokens(sequence)
        first = next((row["step_id"] for row in rows if row["kind"] != "preempted"), None)
        if received and first == step.step_id:  # its first step: the K/V it computed not had arrived before
            extra["received_tokens"] = received
    return labels, about


def _freed_blocks(run: Run, step) -> tuple[dict, dict]:
    """({request: blocks} of the requests released since the previous step (finished or aborted then; the
    worker hears of them with this step), {request: blocks} of those preempted while this step was
    scheduled, to make room): what each held one step earlier."""
    tables = run.block_tables(step.engine_index)
    earlier = [s for s in tables if s < step.step_id]
    before = tables[max(earlier)] if earlier else {}
    released = {r: before[r] for r in step.released_request_ids if r in before}
    preempted = {r: before[r] for r in step.preempted_request_ids if r in before}
    return released, preempted
