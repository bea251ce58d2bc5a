"""ORCA load reports, as vLLM's metrics_header makes them (vllm/entrypoints/openai/orca_metrics.py)."""

import logging

from tinyserve.entrypoints.api.load_reports import named_metrics, orca_header
from tinyserve.wire.messages import SchedulerStats

METRICS = [("kv_cache_usage_perc", 0.25), ("num_requests_waiting", 3.0)]


def test_the_text_report_is_vllms_named_metrics_after_TEXT():
    assert orca_header("text", METRICS) == (
        "TEXT named_metrics.kv_cache_usage_perc=0.25, named_metrics.num_requests_waiting=3.0")


def test_the_json_report_is_vllms_named_metrics_object_after_JSON():
    assert orca_header("json", METRICS) == (
        'JSON {"named_metrics": {"kv_cache_usage_perc": 0.25, "num_requests_waiting": 3.0}}')


def test_the_format_is_read_in_either_case():
    assert orca_header("TEXT", METRICS) == orca_header("text", METRICS)
    assert orca_header("Json", METRICS) == orca_header("json", METRICS)


def test_no_format_gets_no_report_and_an_unknown_one_none_with_a_warning(caplog):
    assert orca_header("", METRICS) is None
    with caplog.at_level(logging.WARNING, logger="tinyserve.api"):
        assert orca_header("proto", METRICS) is None
    assert "'proto' is not a format of the ORCA load report" in caplog.text


def test_the_report_sums_waiting_requests_and_averages_kv_usage_over_the_engines():
    stats = [SchedulerStats(num_waiting_reqs=2, kv_cache_usage=0.5), SchedulerStats(num_waiting_reqs=1)]
    assert named_metrics(stats) == [("kv_cache_usage_perc", 0.25), ("num_requests_waiting", 3.0)]
    assert named_metrics([SchedulerStats()]) == [("kv_cache_usage_perc", 0.0), ("num_requests_waiting", 0.0)]
