"""The items of a Responses API `input` list, as this server takes them (responses_protocol.py's body holds them).

    message               a role and its content: a string or text parts
    function_call         a call an earlier response made
    function_call_output  its result
    reasoning             an earlier response's reasoning (its content's, else its summary's, text)

A `type` names each; a message may leave it out, as OpenAI's API allows.
"""

from typing import Annotated, Literal

from pydantic import Discriminator, Tag, field_validator

from tinyserve.entrypoints.api.guards.strict_body import StrictBody, Text
from tinyserve.entrypoints.api.tools.structured_protocol import AssistantToolCall, JsonText

ITEM_STATUS = Literal["in_progress", "completed", "incomplete"]


class InputText(StrictBody):
    type: Literal["input_text", "output_text"]
    text: Text


class InputImage(StrictBody):
    """An image in an input message, as an image-text model takes it (tinyserve/multimodal/chat.py)."""

    type: Literal["input_image"]
    image_url: Text  # data:image/...;base64,..., file: or http(s): as the server allows (multimodal/media.py)
    detail: Literal["auto"] = "auto"  # the checkpoint's processor sets an image's size: only "auto" is taken
    file_id: None = None  # the Files API is not served here


class InputMessage(StrictBody):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Text | list[InputText | InputImage]

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else \
            "".join(part.text for part in self.content if isinstance(part, InputText))

    @property
    def template_content(self) -> str | list[dict]:
        """The content as a chat message's: its text, or with images OpenAI's parts, in order (render.py reads them)."""
        if isinstance(self.content, str) or not any(isinstance(part, InputImage) for part in self.content):
            return self.text
        return [{"type": "text", "text": part.text} if isinstance(part, InputText)
                else {"type": "image_url", "image_url": {"url": part.image_url}} for part in self.content]


class FunctionCallItem(StrictBody):
    """A call an earlier response made, handed back with the conversation."""

    type: Literal["function_call"]
    call_id: Text
    name: Text
    arguments: JsonText
    id: Text | None = None
    status: ITEM_STATUS | None = None

    def as_template_call(self) -> dict:
        return AssistantToolCall.model_validate(
            {"id": self.call_id, "function": {"name": self.name, "arguments": self.arguments}}).as_template_call()


class FunctionCallOutputItem(StrictBody):
    type: Literal["function_call_output"]
    call_id: Text
    output: Text | list[InputText]
    id: Text | None = None
    status: ITEM_STATUS | None = None

    @property
    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(part.text for part in self.output)


class ReasoningText(StrictBody):
    type: Literal["reasoning_text", "summary_text"]
    text: Text


class ReasoningItem(StrictBody):
    """Reasoning an earlier response gave, handed back with the conversation."""

    type: Literal["reasoning"]
    id: Text | None = None
    summary: list[ReasoningText] = []
    content: list[ReasoningText] | None = None
    encrypted_content: None = None  # vLLM's: "Encrypted content is not supported."
    status: ITEM_STATUS | None = None

    @property
    def text(self) -> str:
        """vLLM's choice: the first content part's text, else the first summary's."""
        parts = self.content or self.summary
        return parts[0].text if parts else ""


class ReasoningConfig(StrictBody):
    """A request's `reasoning`: its effort goes to the chat template with a reasoning parser (reasoning/layer.py)."""

    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    summary: str | None = None  # "auto" (whichever the model has) only: no summary is made
    generate_summary: str | None = None

    @field_validator("summary", "generate_summary")
    @classmethod
    def _no_summary(cls, value):
        if value not in (None, "auto"):
            raise ValueError(f"{value!r} is not supported by this server: no summary is made (the reasoning, with "
                             "--reasoning-parser, is given whole); give \"auto\" or leave it out")
        return value


def _item_type(item) -> str:
    return item.get("type", "message") if isinstance(item, dict) else getattr(item, "type", "message")


InputItem = Annotated[Annotated[InputMessage, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
                      | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
                      | Annotated[ReasoningItem, Tag("reasoning")], Discriminator(_item_type)]
