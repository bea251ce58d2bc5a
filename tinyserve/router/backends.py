"""The router's view of its backends: where each is, whether it answers, how loaded it is.

The load a backend reports comes in two ways, both vLLM's (entrypoints/api/load_reports.py):
the ORCA header on whole chat and completion answers (the router asks for it on every
request it forwards) and GET /load. The router adds what it knows best: how many of its
own requests are in flight there now.
"""

import time
from dataclasses import dataclass, field

DOWN_FOR_S = 2.0  # a backend that refused a connection is skipped this long, then tried again


@dataclass
class Backend:
    url: str  # http://host:port, no trailing slash
    index: int  # its place in --backend: the order --kv-events follows
    in_flight: int = 0  # requests the router forwarded that have not finished answering
    routed: int = 0  # requests the router forwarded here, ever: the last tie-break, to spread new prefixes
    num_requests_waiting: float = 0.0  # the latest ORCA report's, or 0
    kv_cache_usage_perc: float = 0.0
    down_until: float = 0.0  # time.monotonic() before which it is not chosen
    last_error: str = ""
    loads: dict = field(default_factory=dict)  # the latest ORCA named metrics, as reported

    def is_up(self) -> bool:
        return time.monotonic() >= self.down_until

    def mark_down(self, error: str) -> None:
        self.down_until = time.monotonic() + DOWN_FOR_S
        self.last_error = error

    def load(self) -> tuple[float, float, int, int]:
        """What least_load compares, smallest first: requests waiting or in flight there, KV usage, then
        how many the router sent there so far (so an idle pair takes turns), then its place."""
        return (self.num_requests_waiting + self.in_flight, self.kv_cache_usage_perc, self.routed, self.index)

    def read_orca(self, header: str | None) -> None:
        """Take an `endpoint-load-metrics` header (TEXT or JSON form) as the backend's latest load."""
        metrics = parse_orca(header) if header else {}
        if metrics:
            self.loads = metrics
            self.num_requests_waiting = metrics.get("num_requests_waiting", 0.0)
            self.kv_cache_usage_perc = metrics.get("kv_cache_usage_perc", 0.0)


def parse_orca(header: str) -> dict[str, float]:
    """`TEXT named_metrics.a=1.0, named_metrics.b=2.0` or `JSON {"named_metrics": {...}}` → {a: 1.0, b: 2.0}."""
    import json

    kind, _, rest = header.strip().partition(" ")
    try:
        if kind.upper() == "JSON":
            return {k: float(v) for k, v in json.loads(rest).get("named_metrics", {}).items()}
        if kind.upper() == "TEXT":
            pairs = (item.strip().partition("=") for item in rest.split(","))
            return {k.removeprefix("named_metrics."): float(v) for k, _, v in pairs if k}
    except (ValueError, AttributeError):
        pass
    return {}
