"""plots_scale_out: the balancer's rule replayed from a trace, a router's view, TP steps, one request's hops.

The rule is checked on the synthetic demo run (tests/synthetic_trace.py), whose step
reports and send times are round milliseconds, so every decision can be worked out by
hand; the hops and the tensor-parallel steps on the recorded runs in traces/.
"""

from pathlib import Path

import pytest
from matplotlib.figure import Figure

from tests.synthetic_trace import write_demo_run
from tinyserve.lifecycle import schema
from tinyserve.trace_reading import load_run, plots_scale_out

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    return load_run(write_demo_run(tmp_path_factory.mktemp("demo") / "run"))


def test_the_balancer_rule_replayed_from_the_step_reports_explains_each_choice_or_shows_the_lag(demo_run):
    decisions = {d.request_id: d for d in plots_scale_out.balancer_decisions(demo_run)}
    # chatcmpl-a at 1.5 ms: no engine has reported yet; the lowest index wins the tie.
    assert decisions["chatcmpl-a"].loads == {0: (0, 0), 1: (0, 0)} and decisions["chatcmpl-a"].agrees
    # 0_cmpl-b at 11.5 ms: engine 0 reported at 10 ms that it runs chatcmpl-a; engine 1 has said nothing.
    assert decisions["0_cmpl-b"].loads == {0: (0, 1), 1: (0, 0)} and decisions["0_cmpl-b"].agrees
    assert decisions["0_cmpl-b"].report_age_s[0] == pytest.approx(0.0015) and decisions["0_cmpl-b"].report_age_s[1] is None
    # 1_cmpl-b at 11.6 ms: engine 1 counts the request sent to it since; the rule would pick engine 0,
    # the trace says engine 1: the replay does not see what the balancer had received.
    assert decisions["1_cmpl-b"].loads == {0: (0, 1), 1: (1, 0)}
    assert decisions["1_cmpl-b"].replayed_engine == 0 and not decisions["1_cmpl-b"].agrees
    # chatcmpl-c at 31.5 ms: engine 1's report at 22 ms had one waiting and two running.
    assert decisions["chatcmpl-c"].loads == {0: (0, 1), 1: (1, 2)} and decisions["chatcmpl-c"].agrees
    assert isinstance(plots_scale_out.plot_balancer_decisions(demo_run), Figure)


def test_least_connections_counts_what_each_rank_had_in_flight_at_each_arrival(demo_run):
    rows = plots_scale_out.least_connections(demo_run.requests)
    assert [(r["rank"], r["in_flight"]) for r in rows] == [(0, {0: 0, 1: 0}), (1, {0: 1, 1: 0}), (0, {0: 1, 1: 1})]
    assert all(r["went_to_a_least_loaded_rank"] for r in rows)


def test_tensor_parallel_steps_plot_every_rank_and_refuse_a_run_without_them(demo_run):
    run = load_run(ROOT / "traces" / "recorded-load-tp2")
    step = next(s for s in run.steps if s.ranks)
    assert [r["rank"] for r in step.ranks] == [0, 1]
    assert all(0 <= r["all_reduce_s"] <= r["execute_s"] for r in step.ranks)
    assert isinstance(plots_scale_out.plot_tensor_parallel_steps(run), Figure)
    with pytest.raises(ValueError, match="has no tensor-parallel steps"):
        plots_scale_out.plot_tensor_parallel_steps(demo_run)


def test_a_request_served_by_the_headless_node_has_hops_in_the_api_and_in_engine_1():
    run = load_run(ROOT / "traces" / "recorded-multi-node")
    request = next(r for r in run.requests if r.sequences[0].engine_index == 1)
    hops = plots_scale_out.trace_hops(request, run.spans)
    services = [h["service"] for h in hops]
    assert services[0] == schema.SERVICE_API and schema.engine_service_name(1) in services
    engine_hops = [h for h in hops if h["service"] == schema.engine_service_name(1)]
    assert {h["span"] for h in engine_hops} == {schema.QUEUE, schema.PREFILL, schema.DECODE}
    assert all(h["dp_rank"] == 1 and h["tp_rank"] == 0 and h["host"] for h in engine_hops)
    assert [h["start_ms"] for h in hops] == sorted(h["start_ms"] for h in hops)
