"""The request fields that constrain what is generated: response_format, structured_outputs, tools.

    response_format  {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}   OpenAI
                     {"type": "json_object"}  ·  {"type": "text"} (no constraint)
    structured_outputs  {"json" | "regex" | "choice" | "grammar" | "json_object"}        vLLM's extra
    tools, tool_choice  function tools; "required" and a named function are constrained
                        too, with a JSON schema over the tools' parameters (tool_calls.py)

Each becomes one StructuredOutputsParams for the engine; two of them at once is a 400, as is
a schema the engine's grammar library cannot compile (checked by the input processor).
"""

import json
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, field_validator, model_validator

from tinyserve.entrypoints.api.guards.strict_body import StrictBody, Text
from tinyserve.errors import InvalidInputError
from tinyserve.sampling_params import StructuredOutputsParams
from tinyserve.structured_output.schema_check import check_json_schema


def _json_text(value: str) -> str:
    try:
        json.loads(value)
    except ValueError:
        raise ValueError("must be JSON text") from None
    return value


JsonText = Annotated[Text, AfterValidator(_json_text)]  # a call's arguments, as OpenAI sends them


class JsonSchemaFormat(StrictBody):
    name: Text = Field(max_length=64)
    description: Text | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None  # the schema is enforced whether or not it is strict

    @field_validator("schema_")
    @classmethod
    def _usable_schema(cls, value):
        check_json_schema(value, "response_format")
        return value


class ResponseFormat(StrictBody):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_iff_json_schema(self) -> "ResponseFormat":
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError('json_schema is required with type "json_schema", and only then')
        return self

    def structured_outputs(self) -> StructuredOutputsParams | None:
        if self.type == "json_schema":
            return StructuredOutputsParams(json=self.json_schema.schema_)
        if self.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        return None


class StructuredOutputsField(StrictBody):
    """vLLM's `structured_outputs` (extra_body): exactly one constraint."""

    json_: dict[str, Any] | Text | None = Field(None, alias="json")
    regex: Text | None = None
    choice: list[Text] | None = None
    grammar: Text | None = None
    json_object: bool | None = None

    def structured_outputs(self) -> StructuredOutputsParams:
        return StructuredOutputsParams(json=self.json_, regex=self.regex, choice=self.choice, grammar=self.grammar,
                                       json_object=bool(self.json_object))


class ConstrainedFields(StrictBody):
    """Mixed into chat and completions requests: the constraint fields and the one constraint they make."""

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None

    @model_validator(mode="after")
    def _one_constraint(self) -> "ConstrainedFields":
        self.constraint()
        return self

    def constraint(self) -> tuple[StructuredOutputsParams | None, str | None]:
        """(the constraint, the field it came from); a ValueError if two fields constrain at once."""
        given = [(params, name) for params, name in (
            (self.response_format.structured_outputs() if self.response_format else None, "response_format"),
            (self.structured_outputs.structured_outputs() if self.structured_outputs else None, "structured_outputs"),
        ) if params is not None]
        if len(given) > 1:
            raise ValueError("response_format and structured_outputs cannot both constrain the output; give one")
        return given[0] if given else (None, None)


class FunctionDefinition(StrictBody):
    name: Text = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: Text | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; none: no arguments
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _usable_schema(cls, value):
        if value is not None:  # checked even when tool_choice is "none": the template shows it
            check_json_schema(value, "tools")
        return value

    @property
    def parameters_schema(self) -> dict:
        return self.parameters or {"type": "object", "properties": {}}


class Tool(StrictBody):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(StrictBody):
    name: Text


class NamedToolChoice(StrictBody):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class CalledFunction(StrictBody):
    name: Text
    arguments: JsonText


class AssistantToolCall(StrictBody):
    """A call an earlier assistant turn made, sent back with the conversation."""

    id: Text
    type: Literal["function"] = "function"
    function: CalledFunction

    def as_template_call(self) -> dict:
        arguments = json.loads(self.function.arguments)
        return {"id": self.id, "type": "function", "function": {"name": self.function.name, "arguments": arguments}}


def check_tool_choice(tools: list[Tool] | None, tool_choice, constrained: bool) -> None:
    """tool_choice without tools, a named function that is not among them, or a tool_choice that
    constrains the output as well as response_format or structured_outputs: each a ValueError."""
    if tool_choice is not None and tool_choice != "none" and not tools:
        raise InvalidInputError("tool_choice needs tools: give the tools the model may call", "tool_choice")
    names = [tool.function.name for tool in tools or ()]
    if len(set(names)) != len(names):
        raise InvalidInputError(f"tools must have distinct names, got {names}", "tools")
    if isinstance(tool_choice, NamedToolChoice) and tool_choice.function.name not in names:
        raise InvalidInputError(f"tool_choice names the function {tool_choice.function.name!r}, which is not "
                                f"among the tools {names}", "tool_choice")
    if constrained and (tool_choice == "required" or isinstance(tool_choice, NamedToolChoice)):
        raise InvalidInputError("a required or named tool_choice constrains the output itself: it cannot be "
                                "combined with response_format or structured_outputs", "tool_choice")
