"""The error a request gets for bad input: InvalidInputError, answered as a 400 naming the field; and
RequestRejectedError, a 503: the server is draining, or its waiting queue is full (QueueFullError).

Its own module, imported by the configuration, the input processor and the grammar layer
alike, so that none of them needs another to name it.
"""


class InvalidInputError(ValueError):
    """A request the engine cannot serve; `param` names the field at fault (the API's error body carries it)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class RequestRejectedError(RuntimeError):
    """A new request was refused before anything was sent: the waiting queue is full, or the server is draining."""

    reason: str | None = None  # vLLM's admission rejection reason (admission_rejections_total), if one


class QueueFullError(RequestRejectedError):
    """The waiting queue is full (--max-waiting-requests): vLLM's max_num_queued_reqs rejection."""

    reason = "max_num_queued_reqs"
