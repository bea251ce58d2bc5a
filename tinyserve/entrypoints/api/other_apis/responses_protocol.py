"""The body of POST /v1/responses (OpenAI's Responses API), and the store behind previous_response_id.

`input` is a string (one user message) or a list of items:

    message               a role and its content: a string or text parts (`input_text`, or
                          `output_text` for an assistant turn handed back from an earlier response)
    function_call         a call an earlier response made: call_id, name, arguments (JSON text)
    function_call_output  its result: call_id, output
    reasoning             an earlier response's reasoning: its content's text (else its summary's) joins
                          the assistant turn as its `reasoning`, as vLLM renders it

`instructions` become a system message in front; calls join the assistant turn before them,
and each output is a "tool" turn, as chat templates take them. `tools` are function tools in
the Responses API's flat shape ({"type": "function", "name", "parameters", ...}: chat's Tool
inside), and `tool_choice` is "auto", "required", "none" or {"type": "function", "name"}; what
they do is chat's (serving_engine.tool_call_plan). `text.format` is "text", "json_object" or
{"type": "json_schema", "name", "schema"}: chat's response_format, flat. `max_tool_calls` bounds
the function calls the output holds (responses_serving.bounded_calls). vLLM's extra fields of
its ResponsesRequest (top_k, repetition_penalty, seed, stop, ignore_eos, include_stop_str_in_output,
skip_special_tokens, logit_bias, structured_outputs, priority), and min_tokens as chat has it, do
what they do in chat; structured_outputs is a constraint as text.format is, and one of the two
at a time. Items, tools and tool choices of other types (web search, file search, MCP, images)
and the fields in request_fields.py's "responses" table are refused with a 400
naming them (`include` only where it asks for what this server cannot give). `reasoning`'s
effort, and `include_reasoning`, are chat's reasoning_effort and include_reasoning (with a
reasoning parser: tinyserve/reasoning/); a summary other than "auto" is refused, as none is made.
The module is over 300 lines because the whole body, with vLLM's extra fields, is here in one
place, where a reader (and tests/test_request_fields.py) finds the whole surface.

With `previous_response_id` the conversation continues one this server answered: its
messages and its reply come first (its instructions do not, as OpenAI's API has it).
Responses are kept in memory, in a `ResponseStore` of bounded size (the oldest goes
first); one made with `store: false` is not kept, and an id that is not (or no longer)
kept is a 404 naming previous_response_id.
"""

from collections import OrderedDict
from typing import Annotated, Any, ClassVar, Literal

import msgspec
from pydantic import ConfigDict, Field, field_validator, model_validator

from tinyserve.entrypoints.api.openai_protocol import INT64, SEED, StrictBody, Text, token_id_keys
from tinyserve.entrypoints.api.other_apis.responses_items import (
    FunctionCallItem,
    FunctionCallOutputItem,
    InputItem,
    ReasoningConfig,
    ReasoningItem,
)
from tinyserve.structured_output.schema_check import check_json_schema
from tinyserve.entrypoints.api.tools.structured_protocol import (
    FunctionDefinition,
    JsonSchemaFormat,
    NamedToolChoice,
    ResponseFormat,
    StructuredOutputsField,
    Tool,
    check_tool_choice,
)
from tinyserve.sampling_params import StructuredOutputsParams

DEFAULT_MAX_STORED_RESPONSES = 1024
DEFAULT_MAX_STORED_RESPONSE_BYTES = 64 << 20  # the store's JSON bytes: a few huge responses cannot fill memory
RESPONSE_ID_PATTERN = r"^resp_[0-9a-f]{32}$"  # the ids this server gives (responses_serving.py)


class FunctionTool(StrictBody):
    """A function tool, as the Responses API spells it: chat's function definition, flat."""

    type: Literal["function"]
    name: Text = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: Text | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _usable_schema(cls, value):
        if value is not None:
            check_json_schema(value, "tools")
        return value

    @field_validator("type", mode="before")
    @classmethod
    def _only_functions(cls, value):
        if value != "function":
            raise ValueError(f"{value!r} tools are not supported: this server calls function tools only "
                             "(no hosted tools: web search, file search, MCP, code interpreter, ...)")
        return value

    def as_chat_tool(self) -> Tool:
        function = FunctionDefinition.model_validate(self.model_dump(exclude={"type"}))
        return Tool(type="function", function=function)


class NamedFunctionChoice(StrictBody):
    type: Literal["function"]
    name: Text

    @field_validator("type", mode="before")
    @classmethod
    def _only_functions(cls, value):
        if value != "function":
            raise ValueError(f"a tool_choice of type {value!r} is not supported: give \"auto\", \"required\", "
                             "\"none\" or {\"type\": \"function\", \"name\": ...}")
        return value


class TextFormat(StrictBody):
    """text.format: {"type": "text"}, {"type": "json_object"} or {"type": "json_schema", "name", "schema"}."""

    # What _name_and_schema_iff_json_schema checks, said in the schema.
    model_config = StrictBody.model_config | ConfigDict(json_schema_extra={
        "if": {"properties": {"type": {"const": "json_schema"}}, "required": ["type"]},
        "then": {"required": ["name", "schema"],
                 "properties": {"name": {"type": "string"}, "schema": {"type": "object"}}},
        "else": {"properties": {"name": {"type": "null"}, "schema": {"type": "null"}}}})

    type: Literal["text", "json_object", "json_schema"]
    name: Text | None = Field(None, max_length=64)
    description: Text | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None

    @model_validator(mode="after")
    def _name_and_schema_iff_json_schema(self) -> "TextFormat":
        if (self.type == "json_schema") != (self.name is not None and self.schema_ is not None):
            raise ValueError('name and schema are required with type "json_schema", and only then')
        return self

    def as_response_format(self) -> ResponseFormat:
        """The same constraint as chat's response_format."""
        if self.type != "json_schema":
            return ResponseFormat(type=self.type)
        schema = JsonSchemaFormat.model_validate(self.model_dump(by_alias=True, exclude={"type"}, exclude_none=True))
        return ResponseFormat(type=self.type, json_schema=schema)


class TextConfig(StrictBody):
    format: TextFormat | None = None
    verbosity: Literal["medium"] | None = None  # the API's default; the model has no verbosity to set


class ResponsesRequest(StrictBody):
    refused_fields: ClassVar[str] = "responses"
    model: Text | None = None
    input: Text | list[InputItem]
    instructions: Text | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stream: bool = False
    store: bool = True
    previous_response_id: Text | None = None
    user: Text | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None = None  # "auto" with tools
    parallel_tool_calls: bool = True
    max_tool_calls: int | None = Field(None, ge=1)  # the most function calls the output holds (bounded_calls)
    text: TextConfig | None = None
    # "auto" is accepted: it changes nothing while the input fits, and one that does not is a 400 naming it
    truncation: Literal["auto", "disabled"] | None = None
    # vLLM's extras (its ResponsesRequest's sampling fields, and min_tokens as chat has it)
    top_k: int | None = Field(None, ge=-1, lt=2**31)  # the sampler's int32; -1 and 0: off
    repetition_penalty: float | None = Field(None, gt=0)
    seed: int | None = Field(None, **SEED)
    stop: Text | list[Text] | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0, lt=2**31)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = None  # {"token id": bias}
    structured_outputs: StructuredOutputsField | None = None
    priority: int = Field(0, ge=-INT64, lt=INT64)
    # "message.output_text.logprobs": each output_text part carries its tokens' logprobs, with top_logprobs
    # alternatives each (as chat's); the other items OpenAI names are of things this server never makes
    include: list[Text] | None = None
    # vLLM's: the response object also carries input_messages and output_messages, the model's raw input (the
    # rendered prompt) and output, each {"message": text, "tokens": ids, "type": "raw_message_tokens"}
    enable_response_messages: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    reasoning: ReasoningConfig | None = None
    include_reasoning: bool = True  # vLLM's: false leaves the reasoning item out

    @field_validator("include")
    @classmethod
    def _includable(cls, value):
        from tinyserve.entrypoints.api.request_fields import INCLUDABLE

        unknown = [item for item in value or () if item not in INCLUDABLE]
        if unknown:
            raise ValueError(f"cannot include {unknown}: the items are {list(INCLUDABLE)}")
        return value

    @property
    def includes_logprobs(self) -> bool:
        return "message.output_text.logprobs" in (self.include or ())

    @field_validator("input", mode="before")
    @classmethod
    def _messages_within_limits(cls, value):
        return cls.limits.check_messages(value) if isinstance(value, list) else value

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_within_limits(cls, value):
        return cls.limits.check_stop(value)

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _logit_bias_within_limits(cls, value):
        return cls.limits.check_logit_bias(value)

    @field_validator("logit_bias")
    @classmethod
    def _token_id_keys(cls, value):
        return token_id_keys(value)

    @model_validator(mode="after")
    def _consistent_tools(self) -> "ResponsesRequest":
        chat_choice = self.tool_choice  # in chat's shape, for chat's checks
        if isinstance(chat_choice, NamedFunctionChoice):
            chat_choice = NamedToolChoice.model_validate({"type": "function", "function": {"name": chat_choice.name}})
        check_tool_choice(self.chat_tools, chat_choice, constrained=False)
        if self.structured_outputs is not None and self.text is not None and self.text.format is not None \
                and self.text.format.type != "text":
            raise ValueError("structured_outputs and text.format cannot both constrain the output; give one")
        if self.constraint[0] is not None and (self.tool_choice == "required"
                                            or isinstance(self.tool_choice, NamedFunctionChoice)):
            raise ValueError('a required or named tool_choice constrains the output itself: it cannot be combined '
                             'with a text.format of type "json_schema" or "json_object", or with structured_outputs')
        return self

    @property
    def chat_tools(self) -> list[Tool] | None:
        return [tool.as_chat_tool() for tool in self.tools] if self.tools else None

    @property
    def template_tools(self) -> list[dict] | None:
        """The tools as chat templates take them (OpenAI's chat shape, as dicts)."""
        return [tool.model_dump(exclude_none=True) for tool in self.chat_tools] if self.tools else None

    @property
    def effective_tool_choice(self):
        """None (no tools), "none", "auto", "required" or a function's name as {"name": ...}."""
        if not self.tools:
            return None
        choice = self.tool_choice or "auto"
        return {"name": choice.name} if isinstance(choice, NamedFunctionChoice) else choice

    @property
    def format_constraint(self):
        """The constraint text.format puts on the output (structured_protocol.ResponseFormat's), or None."""
        text_format = self.text.format if self.text is not None else None
        return text_format.as_response_format().structured_outputs() if text_format is not None else None

    @property
    def constraint(self) -> tuple[StructuredOutputsParams | None, str | None]:
        """(the constraint text.format or structured_outputs puts on the output, the field it came from)."""
        if self.structured_outputs is not None:
            return self.structured_outputs.structured_outputs(), "structured_outputs"
        return (self.format_constraint, "text.format") if self.format_constraint is not None else (None, None)

    def sampling_fields(self) -> dict:
        """The sampling fields as ServingContext.sampling_params takes them (None: the server's default)."""
        return {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
                "repetition_penalty": self.repetition_penalty, "seed": self.seed,
                "stop": [self.stop] if isinstance(self.stop, str) else self.stop or None,
                "ignore_eos": self.ignore_eos, "min_tokens": self.min_tokens,
                "include_stop_str_in_output": self.include_stop_str_in_output,
                "skip_special_tokens": self.skip_special_tokens,
                "logit_bias": {int(token_id): bias for token_id, bias in self.logit_bias.items()}
                if self.logit_bias else None,
                "logprobs": (self.top_logprobs or 0) if self.includes_logprobs else None}

    def echo(self) -> dict:
        """tools, tool_choice, parallel_tool_calls and text as a response object repeats them."""
        tool_choice = self.tool_choice or ("auto" if self.tools else "none")
        text_format = self.text.format if self.text is not None and self.text.format is not None else None
        return {
            "tools": [tool.model_dump() for tool in self.tools or ()],
            "tool_choice": tool_choice if isinstance(tool_choice, str) else tool_choice.model_dump(),
            "parallel_tool_calls": self.parallel_tool_calls,
            "text": {"format": text_format.model_dump(by_alias=True, exclude_none=True) if text_format
                     else {"type": "text"}},
        }

    def new_messages(self) -> list[dict]:
        """This request's own turns, in the chat template's terms: a call joins the assistant turn before it."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        turns: list[dict] = []
        for item in self.input:
            if isinstance(item, FunctionCallItem):
                if not turns or turns[-1]["role"] != "assistant":
                    turns.append({"role": "assistant", "content": ""})
                turns[-1].setdefault("tool_calls", []).append(item.as_template_call())
            elif isinstance(item, FunctionCallOutputItem):
                turns.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text})
            elif isinstance(item, ReasoningItem):  # joins the assistant turn before it, if it has none
                if not turns or turns[-1]["role"] != "assistant" or "reasoning" in turns[-1]:
                    turns.append({"role": "assistant", "content": ""})
                turns[-1].update(reasoning=item.text, reasoning_content=item.text)  # templates read either
            elif item.role == "assistant" and turns and turns[-1]["role"] == "assistant" \
                    and not turns[-1]["content"] and "reasoning" in turns[-1]:
                turns[-1]["content"] = item.text  # the message after its reasoning: one turn, as vLLM's
            else:
                turns.append({"role": "system" if item.role == "developer" else item.role,
                              "content": item.template_content})
        return turns


class ResponseStore:
    """Finished responses by id, for previous_response_id and GET /v1/responses/{id}; the oldest go first,
    once there are max_entries of them or their JSON passes max_bytes (the newest one always stays)."""

    def __init__(self, max_entries: int = DEFAULT_MAX_STORED_RESPONSES,
                 max_bytes: int = DEFAULT_MAX_STORED_RESPONSE_BYTES) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self._entries: OrderedDict[str, tuple[list[dict], dict, int]] = OrderedDict()

    def put(self, response: dict, conversation: list[dict]) -> None:
        """conversation: the messages this response answered (no instructions) followed by its reply."""
        size = len(msgspec.json.encode((conversation, response)))
        if (old := self._entries.pop(response["id"], None)) is not None:
            self.num_bytes -= old[2]
        self._entries[response["id"]] = (conversation, response, size)
        self.num_bytes += size
        while len(self._entries) > 1 and (len(self._entries) > self.max_entries or self.num_bytes > self.max_bytes):
            self.num_bytes -= self._entries.popitem(last=False)[1][2]

    def conversation(self, response_id: str) -> list[dict] | None:
        entry = self._entries.get(response_id)
        return None if entry is None else list(entry[0])

    def response(self, response_id: str) -> dict | None:
        entry = self._entries.get(response_id)
        return None if entry is None else entry[1]
