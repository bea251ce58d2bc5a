"""The base of every request body: strict types, finite numbers, valid Unicode, unknown fields ignored.

Types are strict (no "2" for 2), numbers finite, and every string valid Unicode: JSON can
carry a lone surrogate ("\\ud800") that no tokenizer or UTF-8 encoder accepts. A request
body names its table in request_fields.py, of the fields refused when they ask for something.
"""

from typing import Annotated, ClassVar

from pydantic import AfterValidator, BaseModel, ConfigDict, model_validator

from tinyserve.entrypoints.api.guards.field_limits import FieldLimits
from tinyserve.entrypoints.api.request_fields import check_refused


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

    @model_validator(mode="before")
    @classmethod
    def _refuse_unimplemented(cls, data):
        if cls.refused_fields is not None:
            check_refused(cls.refused_fields, data)
        return data
