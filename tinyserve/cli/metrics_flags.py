"""`tinyserve serve` flags for the Prometheus metrics of /metrics (entrypoints/api/metrics.py).

    tinyserve serve MODEL --metrics-prefix vllm

names every metric as vLLM names it (`vllm:num_requests_running`, `vllm:kv_cache_usage_perc`,
...), with vLLM's labels, so that dashboards and alerts written for vLLM work unchanged.
"""

import argparse
import re

from tinyserve.entrypoints.api.defaults import DEFAULT_METRICS_PREFIX

_PREFIX = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")  # a Prometheus name, without the colon that follows it


def metrics_prefix(value: str) -> str:
    """The flag's type: a prefix that makes valid Prometheus names, or argparse's error naming the flag."""
    if not _PREFIX.fullmatch(value):
        raise argparse.ArgumentTypeError(f"must be letters, digits and underscores, not starting with a digit "
                                         f"(a Prometheus name), got {value!r}")
    return value


def add_metrics_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("metrics")
    group.add_argument("--metrics-prefix", type=metrics_prefix, default=DEFAULT_METRICS_PREFIX,
                       help="what the names of /metrics start with, before the colon (default %(default)s; "
                            "vllm: vLLM's names, e.g. vllm:num_requests_running, for vLLM's dashboards and alerts)")
