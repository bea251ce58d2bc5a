"""The body of POST /v1/responses (OpenAI's Responses API), text only, and the store behind previous_response_id.

`input` is a string (one user message) or a list of message items, each a role and
its content: a string or a list of text parts (`input_text`, or `output_text` for an
assistant turn handed back from an earlier response). `instructions` become a system
message in front. Items of other types (function calls and their outputs, images,
reasoning) and the fields in request_fields.py's "responses" table are refused with a
400 naming them.

With `previous_response_id` the conversation continues one this server answered: its
messages and its reply come first (its instructions do not, as OpenAI's API has it).
Responses are kept in memory, in a `ResponseStore` of bounded size (the oldest goes
first); one made with `store: false` is not kept, and an id that is not (or no longer)
kept is a 404 naming previous_response_id.
"""

from collections import OrderedDict
from typing import ClassVar, Literal

from pydantic import Field, field_validator

from tinyserve.entrypoints.api.openai_protocol import StrictBody, Text

DEFAULT_MAX_STORED_RESPONSES = 1024
RESPONSE_ID_PATTERN = r"^resp_[0-9a-f]{32}$"  # the ids this server gives (responses_serving.py)


class InputText(StrictBody):
    type: Literal["input_text", "output_text"]
    text: Text


class InputMessage(StrictBody):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Text | list[InputText]

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class ResponsesRequest(StrictBody):
    refused_fields: ClassVar[str] = "responses"
    model: Text | None = None
    input: Text | list[InputMessage]
    instructions: Text | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stream: bool = False
    store: bool = True
    previous_response_id: Text | None = None
    user: Text | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _messages_within_limits(cls, value):
        return cls.limits.check_messages(value) if isinstance(value, list) else value

    def new_messages(self) -> list[dict]:
        """This request's own turns, in the chat template's terms."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text} for m in self.input]


class ResponseStore:
    """Finished responses by id, for previous_response_id and GET /v1/responses/{id}; the oldest go first."""

    def __init__(self, max_entries: int = DEFAULT_MAX_STORED_RESPONSES) -> None:
        self.max_entries = max_entries
        self._entries: OrderedDict[str, tuple[list[dict], dict]] = OrderedDict()

    def put(self, response: dict, conversation: list[dict]) -> None:
        """conversation: the messages this response answered (no instructions) followed by its reply."""
        self._entries[response["id"]] = (conversation, response)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def conversation(self, response_id: str) -> list[dict] | None:
        entry = self._entries.get(response_id)
        return None if entry is None else list(entry[0])

    def response(self, response_id: str) -> dict | None:
        entry = self._entries.get(response_id)
        return None if entry is None else entry[1]
