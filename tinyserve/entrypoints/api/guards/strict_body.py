"""The base of every request body: strict types, finite numbers, valid Unicode, unknown fields ignored.

Types are strict (no "2" for 2), numbers finite, and every string valid Unicode: JSON can
carry a lone surrogate ("\\ud800") that no tokenizer or UTF-8 encoder accepts. A request
body names its table in request_fields.py, of the fields refused when they ask for something.

A field no body knows (not its own, and in none of its tables in request_fields.py) is
ignored, as in vLLM, and said so, as vLLM says it: one warning per request, "The following
fields were present in the request but ignored: [...]", and, on the answer, the header
X-Ignored-Fields (`IGNORED_FIELDS_HEADER`) naming them. A typo (`max_token`) is then seen
by the client that made it, who may have no way to read the server's log.
"""

import functools
import json
import logging
import types
import typing
from typing import Annotated, ClassVar

from pydantic import AfterValidator, BaseModel, ConfigDict, PrivateAttr, model_validator

from tinyserve.entrypoints.api.guards.field_limits import FieldLimits
from tinyserve.entrypoints.api.request_fields import NO_EFFECT, REFUSED, check_refused

logger = logging.getLogger("tinyserve.api")

# The answer's header naming the fields a request sent and the server ignored, as a JSON array of strings
# (ASCII, any name escaped): "X-" as any header of no standard's, named for what it holds.
IGNORED_FIELDS_HEADER = "X-Ignored-Fields"
MAX_IGNORED_NAMED = 20  # more are counted, not named: a body of 10,000 unknown keys makes no 10,000-name header
MAX_IGNORED_NAME_CHARS = 64


def _check_unicode(text: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ValueError(f"is not valid Unicode: a lone surrogate at character {error.start}") from None
    return text


Text = Annotated[str, AfterValidator(_check_unicode)]


class StrictBody(BaseModel):
    """A request body or part of one: strict types, finite numbers, unknown fields ignored.

    `limits` bound how much a field may hold (field_limits.py); a server binds its own.
    """

    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)
    limits: ClassVar[FieldLimits] = FieldLimits()
    # For a request body: its table in request_fields.py, of the fields refused when they ask for something.
    refused_fields: ClassVar[str | None] = None
    # For a request body: whether the fields it ignores are logged and kept (ignored_fields), as vLLM logs them.
    reports_ignored_fields: ClassVar[bool] = False
    _ignored_fields: list[str] = PrivateAttr(default_factory=list)

    @model_validator(mode="wrap")
    @classmethod
    def _note_ignored_fields(cls, data, handler):
        body = handler(data)
        if cls.reports_ignored_fields and isinstance(data, dict) and isinstance(body, StrictBody):
            ignored = sorted(set(data) - _known_fields(cls))
            if ignored:
                named = [name[:MAX_IGNORED_NAME_CHARS] for name in ignored[:MAX_IGNORED_NAMED]]
                if len(ignored) > MAX_IGNORED_NAMED:
                    named.append(f"... and {len(ignored) - MAX_IGNORED_NAMED} more")
                logger.warning("The following fields were present in the request but ignored: %s", named)
                body._ignored_fields = named
        return body

    @property
    def ignored_fields(self) -> list[str]:
        """The top-level fields the request sent that no part of the server reads (at most MAX_IGNORED_NAMED)."""
        return self._ignored_fields

    @model_validator(mode="before")
    @classmethod
    def _integral_numbers_as_integers(cls, data):
        """1.0 where an integer is wanted is that integer: JSON Schema counts it as one (its "integer" is any
        number with no fraction), and clients and schema-driven testers send it; "1" stays refused."""
        if isinstance(data, dict):
            for name in _integer_fields(cls).intersection(data):
                data[name] = _as_integers(data[name])
        return data

    @model_validator(mode="before")
    @classmethod
    def _refuse_unimplemented(cls, data):
        if cls.refused_fields is not None:
            check_refused(cls.refused_fields, data)
        return data


def with_ignored_fields(response, body: StrictBody):
    """`response` with the IGNORED_FIELDS_HEADER naming the fields `body` ignored, if it ignored any; streamed
    answers too, since the header goes out before the first event."""
    if body.ignored_fields:
        response.headers[IGNORED_FIELDS_HEADER] = json.dumps(body.ignored_fields, separators=(",", ":"))
    return response


@functools.cache
def _known_fields(cls) -> frozenset[str]:
    """The top-level names a body reads: its fields (and aliases), and those its tables in request_fields.py
    refuse or accept without effect."""
    names = {key for name, info in cls.model_fields.items() for key in (name, info.alias) if key}
    if cls.refused_fields is not None:
        names |= REFUSED.get(cls.refused_fields, {}).keys() | NO_EFFECT.get(cls.refused_fields, {}).keys()
    return frozenset(names)


@functools.cache
def _integer_fields(cls) -> frozenset[str]:
    """The names (and aliases) of a body's fields that take integers, or lists of them, and no floats."""
    return frozenset(key for name, info in cls.model_fields.items() if _wants_integers(info.annotation)
                     for key in (name, info.alias) if key)


def _wants_integers(annotation) -> bool:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation is int:
        return True
    if origin is Annotated:
        return _wants_integers(args[0])
    if origin in (typing.Union, types.UnionType):
        return float not in args and any(_wants_integers(arg) for arg in args)
    if origin is list:
        return _wants_integers(args[0])
    return False


def _as_integers(value):
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**63:
        return int(value)
    if isinstance(value, list):
        return [_as_integers(item) for item in value]
    return value
