"""`--enable-per-request-metrics`: the `metrics` object of each answer, vLLM's PerRequestMetrics.

From the engine's own timestamps of the request (wire/messages.py's RequestTimes, which a finished
RequestOutput carries), in milliseconds, as vLLM computes them (its build_per_request_timing_metrics):

    queue_time_ms            queued -> first scheduled
    time_to_first_token_ms   first scheduled -> first token (the prefill, not the queue)
    generation_time_ms       first token -> last token (the decode only)
    mean_itl_ms              generation_time_ms / (tokens - 1), with two tokens or more
    tokens_per_second        tokens / (first scheduled -> last token)

A field whose timestamps are missing is null. As in vLLM, only an answer of one sequence carries it
(n = 1, one prompt): the timestamps of several would not be the answer's; a stream carries it on its
usage chunk (stream_options.include_usage), the one that comes after the last token. vLLM's
`speculative_decoding` member, its per-request acceptance counts, is not computed here (left out).
"""

from tinyserve.wire.messages import RequestTimes


def per_request_metrics(times: RequestTimes | None, num_generated: int) -> dict:
    """The `metrics` object of an answer whose one sequence generated `num_generated` tokens."""
    metrics = dict.fromkeys(("time_to_first_token_ms", "generation_time_ms", "queue_time_ms", "mean_itl_ms",
                             "tokens_per_second"))
    if times is None:
        return metrics
    scheduled, first = times.first_scheduled_time, times.first_token_time
    last = times.token_times[-1] if times.token_times else first
    if scheduled is not None and first is not None:
        metrics["time_to_first_token_ms"] = (first - scheduled) * 1000
    if first is not None and last is not None:
        metrics["generation_time_ms"] = (last - first) * 1000
        if num_generated > 1:
            metrics["mean_itl_ms"] = (last - first) / (num_generated - 1) * 1000
    if scheduled is not None:
        metrics["queue_time_ms"] = (scheduled - times.queued_time) * 1000
        if last is not None and last > scheduled:
            metrics["tokens_per_second"] = num_generated / (last - scheduled)
    return metrics
