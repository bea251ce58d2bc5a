"""Block tables in the trace: rebuilt from the step spans, they equal the engine's own.

The run below has everything that changes a block table: prompts longer than the token
budget (chunked prefill), a pool small enough to preempt, prompts that share a prefix
(prefix-cache hits), n = 2, and an abort between steps.
"""

import pytest

from tests.tiny_checkpoints import tiny_model_with_tokenizer
from tinyserve import LLM, SamplingParams
from tinyserve.frontend.input_processor import ProcessedPrompt
from tinyserve.lifecycle.tracing import shutdown_tracing
from tinyserve.trace_reading import load_run


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """Run a stressful workload offline with tracing on; return (the run, the engine's tables per step)."""
    trace_dir = tmp_path_factory.mktemp("traces")
    try:
        llm = LLM(str(tiny_model_with_tokenizer("llama")), trace_dir=str(trace_dir), num_kv_blocks=14,
                  block_size=4, max_num_batched_tokens=12, max_num_seqs=4)
        kv, scheduler = llm.engine_core.kv_cache_manager, llm.engine_core.scheduler
        engine_tables: dict[int, dict[str, list[int]]] = {}
        schedule = scheduler.schedule

        def schedule_and_snapshot():
            output = schedule()
            if output.is_empty and not output.finished_request_ids:  # an idle step: no span
                return output
            engine_tables[output.step_id] = {rid: kv.get_block_ids(rid) for rid, blocks in kv.req_to_blocks.items()
                                             if blocks}
            return output

        scheduler.schedule = schedule_and_snapshot
        shared = list(range(5, 17))  # three full blocks every prompt below starts with
        params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        llm.generate([{"prompt_token_ids": shared + list(range(30 + i, 36 + i))} for i in range(4)], params,
                     use_tqdm=False)
        llm.generate({"prompt_token_ids": shared + [90, 91]},
                     SamplingParams(temperature=1.0, seed=3, n=2, max_tokens=6, ignore_eos=True), use_tqdm=False)
        # An abort between steps: its blocks go without a finished output in any step.
        engine = llm.llm_engine
        prompt = ProcessedPrompt(None, list(range(40, 50)))
        engine.add_request("doomed", prompt, params, engine.make_requests("doomed", prompt, params))
        engine.step()
        engine.abort_request(["doomed"])
        assert llm.engine_core.has_requests  # as a server's busy loop does: one empty step tells the worker
        llm.engine_core.step()
        llm.generate({"prompt_token_ids": shared + [60]}, params, use_tqdm=False)
        [run_dir] = list(trace_dir.iterdir())
        run = load_run(run_dir)
    finally:
        shutdown_tracing()
    return run, engine_tables, scheduler.num_preemptions


def test_the_workload_exercises_preemption_prefix_hits_and_chunking(recorded):
    run, _, num_preemptions = recorded
    assert num_preemptions > 0
    assert any(s.preempted_request_ids for s in run.steps)
    assert sum(s.prefix_cache_hit_tokens or 0 for s in run.steps) > 0
    assert any(s.num_prefill_requests and s.num_scheduled_tokens == 12 for s in run.steps)  # budget-bound chunks


def test_block_tables_from_the_trace_equal_the_engines_at_every_step(recorded):
    run, engine_tables, _ = recorded
    rebuilt = run.block_tables(0)
    assert set(rebuilt) == set(engine_tables)  # every step with work has a span
    for step_id, tables in engine_tables.items():
        assert rebuilt[step_id] == tables, f"step {step_id}"
        for request_id, blocks in tables.items():
            assert run.block_table(request_id, step_id) == blocks


def test_an_abort_with_nothing_else_running_is_released_on_the_empty_step_that_tells_the_worker(recorded):
    run, engine_tables, _ = recorded
    [release] = [s for s in run.steps if "doomed" in s.released_request_ids]
    assert release.request_ids == [] and release.num_scheduled_tokens == 0
    before = max(step_id for step_id in engine_tables if step_id < release.step_id)
    assert run.block_table("doomed", before)  # it held blocks until then
    assert run.block_table("doomed", release.step_id) is None
    assert release.kv_blocks_used == 0  # nothing else held any


def test_a_request_that_holds_no_blocks_has_no_table(recorded):
    run, engine_tables, _ = recorded
    first_step = min(engine_tables)
    assert run.block_table("doomed", first_step) is None
    assert run.block_table("no-such-request", max(engine_tables)) is None


def test_the_block_map_colours_each_block_by_its_owner_and_greys_shared_ones(recorded):
    from tinyserve.trace_reading.plots_blocks import plot_block_map

    run, engine_tables, _ = recorded
    figure = plot_block_map(run)
    [image] = figure.axes[0].get_images()
    grid = image.get_array()  # 0: shared, 1: free, 2 + k: the k-th request to hold blocks
    steps = sorted(engine_tables)
    owners = list(dict.fromkeys(r for step in steps for r in engine_tables[step]))
    for column, step_id in enumerate(steps):
        holders = {}
        for request_id, blocks in engine_tables[step_id].items():
            for block in blocks:
                holders.setdefault(block, []).append(request_id)
        for block in range(grid.shape[0]):
            owners_here = holders.get(block, [])
            expected = 1 if not owners_here else 0 if len(owners_here) > 1 else 2 + owners.index(owners_here[0])
            assert grid[block, column] == expected, (step_id, block)
    assert (grid == 0).any()  # the shared prefix shows


def test_a_preempted_request_waits_then_recomputes_as_prefill_in_the_kv_pressure_plot(recorded):
    from tinyserve.lifecycle import schema
    from tinyserve.trace_reading import plots_extra

    run, _, _ = recorded
    steps = run.engine_steps(0)
    preempted = [q for r in run.requests for q in r.sequences if q.preemption_times_ns]
    assert preempted
    for sequence in preempted:
        segments = plots_extra.recompute_segments(sequence, steps)
        queued = [s for s in segments if s[0] == schema.QUEUE]
        recomputed = [s for s in segments if s[0] == schema.PREFILL]
        assert [start for _, start, _ in queued] == sequence.preemption_times_ns
        assert len(recomputed) == len(queued)  # a recompute always has its prompt to prefill again
        for (_, _, resumed_ns), (_, start_ns, end_ns) in zip(queued, recomputed):
            assert start_ns == resumed_ns < end_ns
            during = [n for s in steps if start_ns <= s.start_ns < end_ns
                      for rid, n in zip(s.request_ids, s.num_tokens_per_request) if rid == sequence.request_id]
            after = [n for s in steps if s.start_ns >= end_ns
                     for rid, n in zip(s.request_ids, s.num_tokens_per_request) if rid == sequence.request_id]
            assert during and all(n > 1 for n in during)
            assert not after or after[0] == 1  # then it decodes on, one token a step
