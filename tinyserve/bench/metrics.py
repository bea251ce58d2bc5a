"""Serving metrics from the timed requests, with vLLM's definitions and its result table.

Per successful request (request_funcs.py records the timestamps):

    TTFT   time to first token: sent → first token chunk
    TPOT   time per output token, the first excluded: (E2EL − TTFT) / (output tokens − 1),
           for requests of more than one token
    ITL    inter-token latency: every gap between consecutive chunks, of all requests pooled
    E2EL   end-to-end latency: sent → last chunk

Over the run (duration = first request sent → last request done):

    request throughput   completed requests / duration
    output throughput    output tokens / duration
    total throughput     (input + output tokens) / duration
    goodput              requests meeting every SLO given (--goodput ttft:MS tpot:MS e2el:MS)
                         / duration; a one-token request's TPOT counts as 0 here

Each latency is summarized by its mean, median, standard deviation and the chosen
percentiles (linear interpolation, as numpy and vLLM compute them), in milliseconds.
"""

from dataclasses import dataclass

import numpy as np

from tinyserve.bench.request_funcs import RequestFuncOutput

METRICS = {  # name: (short label, section title)
    "ttft": ("TTFT", "Time to First Token"),
    "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
    "itl": ("ITL", "Inter-token Latency"),
    "e2el": ("E2EL", "End-to-end Latency"),
}
GOODPUT_METRICS = ("ttft", "tpot", "e2el")
TABLE_WIDTH = 50


def parse_percentile_metrics(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in METRICS]
    if unknown or not names:
        raise ValueError(f"percentile_metrics must be a comma-separated subset of {','.join(METRICS)}, got {text!r}")
    return names


def parse_metric_percentiles(text: str) -> list[float]:
    try:
        percentiles = [float(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise ValueError(f"metric_percentiles must be comma-separated numbers, got {text!r}") from None
    if not percentiles or not all(0 < p < 100 for p in percentiles):
        raise ValueError(f"metric_percentiles must be numbers in (0, 100), got {text!r}")
    return percentiles


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """["ttft:100", "tpot:20"] → {"ttft": 0.1, "tpot": 0.02} (SLOs in seconds)."""
    slos = {}
    for item in items or []:
        name, _, value = item.partition(":")
        if name not in GOODPUT_METRICS:
            raise ValueError(f"goodput takes NAME:MILLISECONDS with NAME one of {', '.join(GOODPUT_METRICS)}, "
                             f"got {item!r}")
        try:
            milliseconds = float(value)
        except ValueError:
            raise ValueError(f"goodput {name} must be a number of milliseconds, got {value!r}") from None
        if milliseconds < 0:
            raise ValueError(f"goodput {name} must be non-negative, got {milliseconds}")
        slos[name] = milliseconds / 1000
    return slos


@dataclass(slots=True)
class LatencyStats:
    mean_ms: float
    median_ms: float
    std_ms: float
    percentiles_ms: list[tuple[float, float]]  # (percentile, value)

    @classmethod
    def of(cls, seconds: list[float], percentiles: list[float]) -> "LatencyStats":
        values = np.asarray(seconds or [0.0]) * 1000
        return cls(float(np.mean(values)), float(np.median(values)), float(np.std(values)),
                   [(p, float(np.percentile(values, p))) for p in percentiles])


@dataclass(slots=True)
class BenchmarkMetrics:
    completed: int
    failed: int
    total_input: int
    total_output: int
    duration: float
    request_goodput: float | None  # None when no SLO was given
    latencies: dict[str, LatencyStats]  # by metric name: ttft, tpot, itl, e2el

    @property
    def request_throughput(self) -> float:
        return self.completed / self.duration

    @property
    def output_throughput(self) -> float:
        return self.total_output / self.duration

    @property
    def total_token_throughput(self) -> float:
        return (self.total_input + self.total_output) / self.duration


def calculate_metrics(outputs: list[RequestFuncOutput], duration: float, percentiles: list[float],
                      goodput_slos: dict[str, float]) -> BenchmarkMetrics:
    done = [o for o in outputs if o.success]
    goodput = None
    if goodput_slos:
        def meets_slos(o: RequestFuncOutput) -> bool:
            measured = {"ttft": o.ttft, "tpot": o.tpot, "e2el": o.latency}
            return all(measured[name] <= slo for name, slo in goodput_slos.items())

        goodput = sum(meets_slos(o) for o in done) / duration
    samples = {
        "ttft": [o.ttft for o in done],
        "tpot": [o.tpot for o in done if o.output_tokens > 1],  # TPOT is undefined for one token
        "itl": [gap for o in done for gap in o.itl],
        "e2el": [o.latency for o in done],
    }
    return BenchmarkMetrics(
        completed=len(done),
        failed=len(outputs) - len(done),
        total_input=sum(o.prompt_len for o in done),
        total_output=sum(o.output_tokens for o in done),
        duration=duration,
        request_goodput=goodput,
        latencies={name: LatencyStats.of(values, percentiles) for name, values in samples.items()},
    )


def _row(label: str, value) -> str:
    text = f"{value:<10.2f}" if isinstance(value, float) else f"{value!s:<10}"
    return f"{label:<40} {text}"


def _percentile_label(p: float) -> str:
    return f"P{int(p)}" if p == int(p) else f"P{p}"


def format_metrics(metrics: BenchmarkMetrics, selected: list[str], max_concurrency: int | None,
                   request_rate: float) -> str:
    """vLLM's result block, row for row."""
    lines = [f"{' Serving Benchmark Result ':=^{TABLE_WIDTH}}", _row("Successful requests:", metrics.completed)]
    if metrics.failed:
        lines.append(_row("Failed requests:", metrics.failed))
    if max_concurrency is not None:
        lines.append(_row("Maximum request concurrency:", max_concurrency))
    if request_rate != float("inf"):
        lines.append(_row("Request rate configured (RPS):", float(request_rate)))
    lines += [
        _row("Benchmark duration (s):", metrics.duration),
        _row("Total input tokens:", metrics.total_input),
        _row("Total generated tokens:", metrics.total_output),
        _row("Request throughput (req/s):", metrics.request_throughput),
    ]
    if metrics.request_goodput is not None:
        lines.append(_row("Request goodput (req/s):", metrics.request_goodput))
    lines += [
        _row("Output token throughput (tok/s):", metrics.output_throughput),
        _row("Total Token throughput (tok/s):", metrics.total_token_throughput),
    ]
    for name in selected:
        label, title = METRICS[name]
        stats = metrics.latencies[name]
        lines += [
            f"{title:-^{TABLE_WIDTH}}",
            _row(f"Mean {label} (ms):", stats.mean_ms),
            _row(f"Median {label} (ms):", stats.median_ms),
        ]
        lines += [_row(f"{_percentile_label(p)} {label} (ms):", value) for p, value in stats.percentiles_ms]
    lines.append("=" * TABLE_WIDTH)
    return "\n".join(lines)


def metrics_json(metrics: BenchmarkMetrics) -> dict:
    """The figures under vLLM's result-file keys (mean_ttft_ms, p99_itl_ms, …)."""
    result = {
        "duration": metrics.duration,
        "completed": metrics.completed,
        "failed": metrics.failed,
        "total_input_tokens": metrics.total_input,
        "total_output_tokens": metrics.total_output,
        "request_throughput": metrics.request_throughput,
        "request_goodput": metrics.request_goodput,
        "output_throughput": metrics.output_throughput,
        "total_token_throughput": metrics.total_token_throughput,
    }
    for name, stats in metrics.latencies.items():
        result[f"mean_{name}_ms"] = stats.mean_ms
        result[f"median_{name}_ms"] = stats.median_ms
        result[f"std_{name}_ms"] = stats.std_ms
        for p, value in stats.percentiles_ms:
            result[f"{_percentile_label(p).lower()}_{name}_ms"] = value
    return result
