"""The error a request gets for bad input: InvalidInputError, answered as a 400 naming the field.

Its own module, imported by the configuration, the input processor and the grammar layer
alike, so that none of them needs another to name it.
"""


class InvalidInputError(ValueError):
    """A request the engine cannot serve; `param` names the field at fault (the API's error body carries it)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param
