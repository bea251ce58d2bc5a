"""Where a request's time to first token went: arrival → first token cut into consecutive pieces.

    ttft_breakdown(request)   {piece: seconds}, the pieces of TTFT_PIECES in order, adding up to TTFT

One breakdown for every reader: chapter 1 prints it and plots_extra.plot_ttft_breakdown draws it,
`tinyserve trace request` prints it in milliseconds (views.py). The pieces are a partition of
arrival → first token, never negative: the stage spans overlap (ipc.send runs inside enqueue, and
the engine may take a request in before the API's ipc.send has ended), so adding the spans'
durations counts some time twice; cutting at their edges counts it once.
"""

from tinyserve.lifecycle import schema
from tinyserve.trace_reading.timeline import RequestTimeline

# The consecutive pieces, in order (plots_extra.TTFT_SEGMENTS gives each its colour).
TTFT_PIECES = (
    "before render (HTTP, validation)",
    "render",
    "enqueue",
    "ipc.send",
    "IPC + wait for the step in flight",
    "queue",
    "prefill",
)


def ttft_breakdown(request: RequestTimeline) -> dict[str, float]:
    """Where the request's TTFT went, in seconds, as consecutive intervals that add up to TTFT.

    The boundaries are span edges: arrival → render start → render end → ipc.send start →
    ipc.send end → engine queue start → first scheduled → first token. A stage the run does
    not have (offline: no ipc.send) is an interval of zero, and the small gaps between spans
    fall into the interval after them, so nothing is lost or counted twice. Where spans
    overlap, the later stage keeps the overlap: the engine may take a request in before the
    API's ipc.send span has ended (the message left at its start), and then ipc.send is
    counted only up to the engine's queue start.

    "IPC + wait for the step in flight" ends when the engine loop takes the request in,
    between two steps: it holds the ZeroMQ transit and the rest of the step that was running.
    It is the one interval measured across two processes' clocks (same host: they agree to
    well under a millisecond). The completion followed is the one whose token came first.
    """
    first = request.first_token_ns
    if first is None:
        return {}
    sequence = min((s for s in request.sequences if s.first_token_ns is not None), key=lambda s: s.first_token_ns)
    render, send, queue = request.stages.get(schema.RENDER), sequence.stages.get(schema.IPC_SEND), sequence.queue
    edges = [
        render.start_ns if render else None, render.end_ns if render else None,
        send.start_ns if send else None, send.end_ns if send else None,
        queue.start_ns if queue else None, queue.end_ns if queue else None,
    ]
    bounds = [first]
    for edge in reversed(edges):  # from the first token back: no boundary after the one that follows it
        bounds.append(min(bounds[-1], edge if edge is not None else bounds[-1]))
    bounds = [max(b, request.arrival_ns) for b in [request.arrival_ns, *reversed(bounds)]]
    return {name: (end - start) / 1e9 for name, start, end in zip(TTFT_PIECES, bounds, bounds[1:])}
