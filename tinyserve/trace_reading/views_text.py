"""The text of `tinyserve trace request` and `trace step`: views.py's dicts, for a terminal."""

MAX_BATCH_MATES_SHOWN = 6  # in text; --json has them all


def format_request(view: dict) -> str:
    adapter = f", adapter {view['adapter']}" if view.get("adapter") else ""
    lines = [f"request {view['request_id']}  ({view['operation']}, model {view['model']}{adapter}, "
             f"trace {view['trace_id']})"]
    latency = view["latency_ms"]
    lines.append(f"  prompt {view['num_prompt_tokens']} tokens, output {view['num_output_tokens']}; finish "
                 f"{', '.join(str(r) for r in view['finish_reasons']) or '-'}"
                 + (f"; error: {view['error']}" if view["error"] else ""))
    lines.append(f"  TTFT {_fmt(latency['ttft'])} ms   TPOT {_fmt(latency['tpot'])} ms   E2E {_fmt(latency['e2e'])} ms")
    if view["ttft_breakdown_ms"]:
        parts = [f"{name} {_fmt(ms)}" for name, ms in view["ttft_breakdown_ms"].items() if name != "ttft"]
        lines.append(f"  TTFT = {' + '.join(parts)} ms  (arrival to first token, cut at the span edges)")
    lines += ["", "spans (start and duration in ms from arrival):"]
    for row in view["span_tree"]:
        where = row["service"] + (f"@{row['host']}" if row["host"] else "")
        lines.append(f"  {'  ' * row['depth']}{row['name']:<{max(8, 34 - 2 * row['depth'])}} "
                     f"{_fmt(row['start_ms']):>9} {_fmt(row['duration_ms']):>9}  {where}")
    for sequence in view["sequences"]:
        received = sequence.get("num_received_tokens")
        from_cache = sequence.get("num_prefix_cache_tokens", sequence["num_cached_tokens"])
        lines += ["", f"engine request {sequence['request_id']} on engine {sequence['engine_index']}: "
                      f"{sequence['num_output_tokens']} tokens, {from_cache or 0} prompt tokens from the prefix cache"
                      + (f", {received} whose K/V arrived by transfer from the prefill server" if received else "")
                      + f", {sequence['num_preemptions']} preemption(s)"
                      + (f", seed {sequence['seed']}" if sequence["seed"] is not None else "")]
        stages = ", ".join(f"{name} {_fmt(ms)}" for name, ms in sequence["stages_ms"].items())
        lines.append(f"  stages (ms): {stages}")
        for transfer in sequence.get("kv_transfers", []):
            role = {"consumer": "received (asked for → landed)", "producer": "sent (first pull → consumer done)"}
            lines.append(f"  KV transfer, {role.get(transfer['role'], transfer['role'])}: {transfer['num_blocks']} "
                         f"blocks, {transfer['num_bytes']} bytes in {_fmt(transfer['duration_ms'])} ms over "
                         f"{transfer['connector']}" + (f"; error: {transfer['error']}" if transfer["error"] else ""))
        lines.append(f"  steps that served it ({len(sequence['steps'])}):")
        for row in sequence["steps"]:
            mates = row["batch_mates"]
            shown = ", ".join(mates[:MAX_BATCH_MATES_SHOWN]) + (f", … {len(mates)} in all"
                                                               if len(mates) > MAX_BATCH_MATES_SHOWN else "")
            lines.append(f"    step {row['step_id']:>5}  {row['kind']:<9} "
                         + (_drafts(row) if "drafted" in row else f"{row['tokens']:>5} tokens")
                         + (f"  with {shown}" if mates else ""))
        if sequence["block_table_growth"]:
            lines.append("  block table as it grew:")
            for row in sequence["block_table_growth"]:
                lines.append(f"    step {row['step_id']:>5}  {row['block_ids']}")
        if sequence.get("block_table_note"):
            lines.append(f"  ({sequence['block_table_note']})")
    inputs = view["inputs"]
    lines += ["", "logged inputs:" + (" (redacted: the server was told not to log them)" if inputs["redacted"] else "")]
    if inputs["messages"] is not None:
        lines.append(f"  messages: {inputs['messages']}")
    lines.append(f"  prompt: {inputs['prompt']!r}")
    for image in inputs.get("images") or ():  # each kept in the run's images/ folder by this hash
        lines.append(f"  image {image['mm_hash'][:12]}: placeholders {image['offset']}.."
                     f"{image['offset'] + image['length'] - 1} ({image['length']} tokens)")
    if inputs.get("pooling_params") is not None:  # a pooling request: a vector, not sampled tokens
        lines.append(f"  pooling_params: {inputs['pooling_params']}")
    else:
        lines.append(f"  sampling_params: {inputs['sampling_params']}")
    for completion in view["completions"]:
        lines.append(f"  completion {completion['index']} ({completion['finish_reason']}): {completion['text']!r}")
    return "\n".join(lines)


def _drafts(row: dict, positions: bool = True) -> str:
    """A speculative step's row: positions computed (the newest token and the drafts), not tokens out."""
    freed = row["rollback_freed_block_ids"]
    return ((f"{row['tokens']:>5} positions (" if positions else "(")
            + f"newest token + {row['drafted']} drafts): {row['accepted']} accepted, {row['emitted']} token(s) out; "
            + ("blocks freed by its rollback: " + freed if isinstance(freed, str)
               else f"its rollback freed blocks {freed}" if freed else "its rollback freed no block"))


def format_step(view: dict) -> str:
    phases = view["phases_ms"]
    kv = view["kv_blocks"]
    spec = view.get("speculative")
    unit = "positions" if spec else "tokens"  # a speculative step computes drafts: positions, not tokens
    lines = [f"step {view['step_id']} of engine {view['engine_index']}: at {_fmt(view['start_ms'])} ms, "
             f"{_fmt(view['duration_ms'])} ms (schedule {_fmt(phases['schedule'])}, execute "
             f"{_fmt(phases['execute'])}, update {_fmt(phases['update'])})"
             + (" (execute: stage 0's; the step runs until its batch is back from the last stage)"
                if view.get("pipeline_stages") else ""),
             f"  {len(view['batch'])} requests, {view['num_prefill_tokens']} prefill + {view['num_decode_tokens']} "
             f"decode {unit} of a budget of {view['token_budget']}; {view['num_running']} running, "
             f"{view['num_waiting']} waiting after it"]
    if spec:
        lines.append(f"  speculative: {spec['drafted']} drafts verified, {spec['accepted']} accepted; "
                     + (f"verify {_fmt(spec['verify_ms'])} ms, propose the next {_fmt(spec['propose_ms'])} ms "
                        "(inside execute)" if spec["verify_ms"] is not None
                        else "no forward pass, so no verify or propose time")
                     + ("" if spec["rollback_frees_recorded"] else
                        "\n  (the blocks draft rollbacks freed are not recorded in this run: a table after a rollback, "
                        "and what a released request held, may list one)"))
    if view.get("images"):
        images = view["images"]
        lines.append(f"  images: {images['encoded']} encoded in {_fmt(images['encode_ms'])} ms (inside execute), "
                     f"{images['encoder_cache_hits']} from the encoder cache")
    lines += ["", f"  request                                      {unit:>9}  kind       new KV blocks"]
    for row in view["batch"]:
        lines.append(f"  {row['request_id']:<44} {row['tokens']:>9}  {row['kind'] or '?':<10} {row['new_block_ids']}"
                     + (f"  adapter {row['adapter']}" if row.get("adapter") else ""))
        if "drafted" in row:
            lines.append(f"      {_drafts(row, positions=False)}")
        if row.get("received_tokens"):
            lines.append(f"      {row['received_tokens']} prompt tokens' K/V arrived by transfer (not computed here, "
                         "not from the prefix cache)")
    lines += ["", f"  KV blocks: {kv['used']} used, {kv['free']} free of {kv['total']}; {kv['allocated']} allocated "
                  f"in this step; prefix cache hit {view['prefix_cache_hit_tokens']} tokens"]
    for request_id, blocks in kv["released"].items():
        lines.append(f"    freed before it: {request_id} (finished or aborted since the last step) held {blocks}")
    for request_id, blocks in kv["freed_by_preemption"].items():
        lines.append(f"    freed by preempting {request_id} while scheduling it: {blocks}")
    if view["preempted_request_ids"]:
        lines.append(f"  preempted: {', '.join(view['preempted_request_ids'])}")
    if view["finished_request_ids"]:
        lines.append(f"  finished: {', '.join(view['finished_request_ids'])}")
    for stage in view.get("pipeline_stages", []):
        lines.append(f"  pipeline stage {stage['stage']} (rank {stage['rank']}, {stage['device']}): from "
                     f"+{_fmt(stage['start_ms'])} ms, {_fmt(stage['execute_ms'])} ms = waited "
                     f"{_fmt(stage['recv_wait_ms'])} for its input + computed {_fmt(stage['compute_ms'])}"
                     + (f" ({_fmt(stage['all_reduce_ms'])} in all-reduces)" if stage["all_reduce_ms"] else ""))
    if view.get("pipeline_stages"):
        lines.append("    (a stage's wait for its input: the stage before computing this batch, and any batch "
                     "ahead of it there)")
    for rank in view["tensor_parallel_ranks"]:
        lines.append(f"  tensor-parallel rank {rank['rank']} ({rank['device']}): execute {_fmt(rank['execute_ms'])}"
                     f" ms, {_fmt(rank['all_reduce_ms'])} ms of it in all-reduces")
    if view["grammar_bitmask_ms"] is not None:
        lines.append(f"  grammar bitmask: {_fmt(view['grammar_bitmask_ms'])} ms, computed after scheduling and before "
                     "the forward pass (not beside it), applied by the sampler")
    return "\n".join(lines)


def _fmt(ms: float | None) -> str:
    return "-" if ms is None else f"{ms:.2f}"
