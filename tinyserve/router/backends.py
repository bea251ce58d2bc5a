"""The router's view of its backends: where each is, whether it answers, how loaded it is.

A backend is up until it fails: a request it refused, dropped or left unanswered past
--backend-header-timeout, or --health-failure-threshold health checks in a row (health.py).
It is then passed over, whatever the policy, until a health check finds it answering again.

The load a backend reports comes in two ways, both vLLM's (entrypoints/api/load_reports.py):
the ORCA header on whole chat and completion answers (the router asks for it on every
request it forwards) and GET /load. The router adds what it knows best: how many of its
own requests are in flight there now. A reported value that is not a finite number of zero
or more (NaN, inf, null, a string, a negative) is ignored and logged once: it would win or
lose every comparison of least_load whatever the backend's real load.
"""

import json
import logging
import math
from dataclasses import dataclass, field

logger = logging.getLogger("tinyserve.router")


@dataclass
class Backend:
    url: str  # http://host:port, no trailing slash
    index: int  # its place in --backend: the order --kv-events follows
    in_flight: int = 0  # requests the router forwarded that have not finished answering
    routed: int = 0  # requests the router forwarded here, ever: the last tie-break, to spread new prefixes
    num_requests_waiting: float = 0.0  # the latest ORCA report's, or 0
    kv_cache_usage_perc: float = 0.0
    up: bool = True  # chosen at all; False from a failure until a health check succeeds
    failed_checks: int = 0  # health checks failed in a row
    last_error: str = ""
    loads: dict = field(default_factory=dict)  # the latest ORCA named metrics, as reported and valid
    bad_reports: set = field(default_factory=set)  # ORCA metric names already logged as invalid

    def is_up(self) -> bool:
        return self.up

    def mark_down(self, error: str) -> None:
        """Pass this backend over until a health check finds it answering again."""
        if self.up:
            logger.warning("backend %s is down: %s", self.url, error)
        self.up = False
        self.last_error = error

    def checked(self, error: str | None, failure_threshold: int) -> None:
        """A health check's outcome: None when it answered 200."""
        if error is None:
            if not self.up:
                logger.info("backend %s answers its /health again: it is up", self.url)
            self.up, self.failed_checks = True, 0
            return
        self.failed_checks += 1
        if self.failed_checks >= failure_threshold:
            self.mark_down(f"{error} ({self.failed_checks} health check(s) failed in a row)")

    def load(self) -> tuple[float, float, int, int]:
        """What least_load compares, smallest first: requests waiting or in flight there, KV usage, then
        how many the router sent there so far (so an idle pair takes turns), then its place."""
        return (self.num_requests_waiting + self.in_flight, self.kv_cache_usage_perc, self.routed, self.index)

    def read_orca(self, header: str | None) -> None:
        """Take an `endpoint-load-metrics` header (TEXT or JSON form) as the backend's latest load: its valid
        values; each invalid one is logged (once per metric name) and leaves the previous value in place."""
        metrics, invalid = parse_orca(header) if header else ({}, {})
        for name, value in invalid.items():
            if name not in self.bad_reports:
                self.bad_reports.add(name)
                logger.warning("backend %s reported %s=%s in its ORCA header: not a finite number >= 0, ignored",
                               self.url, name, value)
        self.loads.update(metrics)
        self.num_requests_waiting = metrics.get("num_requests_waiting", self.num_requests_waiting)
        self.kv_cache_usage_perc = metrics.get("kv_cache_usage_perc", self.kv_cache_usage_perc)


def parse_orca(header: str) -> tuple[dict[str, float], dict[str, str]]:
    """`TEXT named_metrics.a=1.0, named_metrics.b=2.0` or `JSON {"named_metrics": {...}}` → ({a: 1.0, b: 2.0},
    {name: what was sent} for each value that is not a finite number >= 0)."""
    kind, _, rest = header.strip().partition(" ")
    raw: dict = {}
    try:
        if kind.upper() == "JSON":
            named = json.loads(rest).get("named_metrics", {})
            raw = dict(named.items())
        elif kind.upper() == "TEXT":
            pairs = (item.strip().partition("=") for item in rest.split(","))
            raw = {k.strip().removeprefix("named_metrics."): v.strip() for k, _, v in pairs if k.strip()}
    except (ValueError, AttributeError, TypeError, RecursionError):
        return {}, {"(header)": header[:200]}
    valid, invalid = {}, {}
    for name, value in raw.items():
        number = _load_value(value)
        if number is None:
            invalid[str(name)] = repr(value)[:100]
        else:
            valid[str(name)] = number
    return valid, invalid


def _load_value(value) -> float | None:
    """A reported load as a float, or None unless it is a finite number >= 0 (a bool is not a number here)."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        return None
    try:
        number = float(value)
    except (ValueError, OverflowError):
        return None
    return number if math.isfinite(number) and number >= 0 else None
