"""Speculative decoding's counters, vLLM's (vllm/v1/spec_decode/metrics.py), from SpecDecodingStats.

    {prefix}:spec_decode_num_drafts                 verifications: a request's drafts checked in one step
    {prefix}:spec_decode_num_draft_tokens           drafts proposed and verified
    {prefix}:spec_decode_num_accepted_tokens        drafts accepted
    {prefix}:spec_decode_num_accepted_tokens_per_pos  accepted drafts at each position (label `position`, 0-based)

The acceptance rate is accepted / draft tokens; the mean accepted length 1 + accepted / drafts.
The engine reports running totals (SchedulerStats.spec_decoding_stats); the server's counters
add the increments, per engine, as the other engine counters do (entrypoints/api/metrics.py).
"""

from dataclasses import dataclass, field

from prometheus_client import Counter as PrometheusCounter

from tinyserve.wire.messages import SpecDecodingStats


class SpecDecodeCounters:
    def __init__(self, prefix: str, registry, labels: list[str]) -> None:
        self.prefix, self.registry, self.labels = prefix, registry, list(labels)
        self.registered = False  # only an engine that speculates has them (vLLM's rule)
        self._seen: dict[tuple, SpecDecodingStats] = {}

    def register(self) -> None:
        if self.registered:
            return
        self.registered = True

        def counter(name, doc, extra=()):
            return PrometheusCounter(f"{self.prefix}:{name}", doc, self.labels + list(extra), registry=self.registry)

        self.num_drafts = counter("spec_decode_num_drafts", "Number of spec decoding drafts.")
        self.num_draft_tokens = counter("spec_decode_num_draft_tokens", "Number of draft tokens.")
        self.num_accepted_tokens = counter("spec_decode_num_accepted_tokens", "Number of accepted tokens.")
        self.num_accepted_tokens_per_pos = counter("spec_decode_num_accepted_tokens_per_pos",
                                                   "Accepted tokens per draft position.", ["position"])

    def observe(self, labels: tuple, stats: SpecDecodingStats | None) -> None:
        """An engine's running totals (None: it does not speculate)."""
        if stats is None:
            return
        self.register()
        seen = self._seen.get(labels) or SpecDecodingStats(num_accepted_tokens_per_pos=[0] * stats.num_spec_tokens)
        self.num_drafts.labels(*labels).inc(stats.num_drafts - seen.num_drafts)
        self.num_draft_tokens.labels(*labels).inc(stats.num_draft_tokens - seen.num_draft_tokens)
        self.num_accepted_tokens.labels(*labels).inc(stats.num_accepted_tokens - seen.num_accepted_tokens)
        for position, (now, before) in enumerate(zip(stats.num_accepted_tokens_per_pos,
                                                     seen.num_accepted_tokens_per_pos)):
            self.num_accepted_tokens_per_pos.labels(*labels, str(position)).inc(now - before)
        self._seen[labels] = stats


# LLM.get_metrics(): vLLM's metric objects (vllm/v1/metrics/reader.py), name and labels, then a value or values.
@dataclass
class Metric:
    name: str
    labels: dict[str, str] = field(default_factory=dict)


@dataclass
class Counter(Metric):
    value: int = 0


@dataclass
class Vector(Metric):
    values: list[int] = field(default_factory=list)


def spec_decode_metrics(prefix: str, stats: SpecDecodingStats, labels: dict[str, str]) -> list[Metric]:
    return [
        Counter(f"{prefix}:spec_decode_num_drafts", dict(labels), stats.num_drafts),
        Counter(f"{prefix}:spec_decode_num_draft_tokens", dict(labels), stats.num_draft_tokens),
        Counter(f"{prefix}:spec_decode_num_accepted_tokens", dict(labels), stats.num_accepted_tokens),
        Vector(f"{prefix}:spec_decode_num_accepted_tokens_per_pos", dict(labels),
               list(stats.num_accepted_tokens_per_pos)),
    ]
