"""The text of `tinyserve trace request` and `trace step`: views.py's dicts, for a terminal."""

MAX_BATCH_MATES_SHOWN = 6  # in text; --json has them all


def format_request(view: dict) -> str:
    lines = [f"request {view['request_id']}  ({view['operation']}, model {view['model']}, trace {view['trace_id']})"]
    latency = view["latency_ms"]
    lines.append(f"  prompt {view['num_prompt_tokens']} tokens, output {view['num_output_tokens']}; finish "
                 f"{', '.join(str(r) for r in view['finish_reasons']) or '-'}"
                 + (f"; error: {view['error']}" if view["error"] else ""))
    lines.append(f"  TTFT {_fmt(latency['ttft'])} ms   TPOT {_fmt(latency['tpot'])} ms   E2E {_fmt(latency['e2e'])} ms")
    if view["ttft_breakdown_ms"]:
        parts = [f"{name} {_fmt(ms)}" for name, ms in view["ttft_breakdown_ms"].items() if name != "ttft"]
        lines.append(f"  TTFT = {' + '.join(parts)} ms")
    lines += ["", "spans (start and duration in ms from arrival):"]
    for row in view["span_tree"]:
        where = row["service"] + (f"@{row['host']}" if row["host"] else "")
        lines.append(f"  {'  ' * row['depth']}{row['name']:<{max(8, 34 - 2 * row['depth'])}} "
                     f"{_fmt(row['start_ms']):>9} {_fmt(row['duration_ms']):>9}  {where}")
    for sequence in view["sequences"]:
        lines += ["", f"engine request {sequence['request_id']} on engine {sequence['engine_index']}: "
                      f"{sequence['num_output_tokens']} tokens, {sequence['num_cached_tokens'] or 0} prompt tokens "
                      f"from the prefix cache, {sequence['num_preemptions']} preemption(s)"
                      + (f", seed {sequence['seed']}" if sequence["seed"] is not None else "")]
        stages = ", ".join(f"{name} {_fmt(ms)}" for name, ms in sequence["stages_ms"].items())
        lines.append(f"  stages (ms): {stages}")
        lines.append(f"  steps that served it ({len(sequence['steps'])}):")
        for row in sequence["steps"]:
            mates = row["batch_mates"]
            shown = ", ".join(mates[:MAX_BATCH_MATES_SHOWN]) + (f", … {len(mates)} in all"
                                                               if len(mates) > MAX_BATCH_MATES_SHOWN else "")
            lines.append(f"    step {row['step_id']:>5}  {row['kind']:<9} {row['tokens']:>5} tokens"
                         + (f"  with {shown}" if mates else ""))
        if sequence["block_table_growth"]:
            lines.append("  block table as it grew:")
            for row in sequence["block_table_growth"]:
                lines.append(f"    step {row['step_id']:>5}  {row['block_ids']}")
    inputs = view["inputs"]
    lines += ["", "logged inputs:" + (" (redacted: the server was told not to log them)" if inputs["redacted"] else "")]
    if inputs["messages"] is not None:
        lines.append(f"  messages: {inputs['messages']}")
    lines.append(f"  prompt: {inputs['prompt']!r}")
    if inputs.get("pooling_params") is not None:  # a pooling request: a vector, not sampled tokens
        lines.append(f"  pooling_params: {inputs['pooling_params']}")
    else:
        lines.append(f"  sampling_params: {inputs['sampling_params']}")
    for completion in view["completions"]:
        lines.append(f"  completion {completion['index']} ({completion['finish_reason']}): {completion['text']!r}")
    return "\n".join(lines)


def format_step(view: dict) -> str:
    phases = view["phases_ms"]
    kv = view["kv_blocks"]
    lines = [f"step {view['step_id']} of engine {view['engine_index']}: at {_fmt(view['start_ms'])} ms, "
             f"{_fmt(view['duration_ms'])} ms (schedule {_fmt(phases['schedule'])}, execute "
             f"{_fmt(phases['execute'])}, update {_fmt(phases['update'])})",
             f"  {len(view['batch'])} requests, {view['num_prefill_tokens']} prefill + {view['num_decode_tokens']} "
             f"decode tokens of a budget of {view['token_budget']}; {view['num_running']} running, "
             f"{view['num_waiting']} waiting after it",
             "", "  request                                       tokens  kind       new KV blocks"]
    for row in view["batch"]:
        lines.append(f"  {row['request_id']:<44} {row['tokens']:>6}  {row['kind'] or '?':<10} {row['new_block_ids']}")
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
    for rank in view["tensor_parallel_ranks"]:
        lines.append(f"  tensor-parallel rank {rank['rank']} ({rank['device']}): execute {_fmt(rank['execute_ms'])}"
                     f" ms, {_fmt(rank['all_reduce_ms'])} ms of it in all-reduces")
    if view["grammar_bitmask_ms"] is not None:
        lines.append(f"  grammar bitmask: {_fmt(view['grammar_bitmask_ms'])} ms, computed after scheduling and before "
                     "the forward pass (not beside it), applied by the sampler")
    return "\n".join(lines)


def _fmt(ms: float | None) -> str:
    return "-" if ms is None else f"{ms:.2f}"
