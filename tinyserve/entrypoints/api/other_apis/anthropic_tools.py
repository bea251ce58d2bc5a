"""Tool use in the Anthropic Messages API, on the same tool calling as the OpenAI endpoint.

Anthropic's names for the same things (tool_calls.py does the work):

    tools: [{name, description, input_schema}]          OpenAI: function tools, parameters
    tool_choice {"type": "auto" | "any" | "tool" | "none"}   "auto" | "required" | named | "none"
    assistant content block {"type": "tool_use", id, name, input}    an assistant's tool_calls
    user content block {"type": "tool_result", tool_use_id, content}  a "tool" message
    user content block {"type": "image", source: base64 or url}      an image_url part (an image-text model)
    stop_reason "tool_use"                               finish_reason "tool_calls"

A stream gives each block its own index: content_block_start (a tool_use block carries its
id and name), then input_json_delta events with the input's JSON text, content_block_stop.
With a reasoning parser (an answer layer) the reasoning comes first, as vLLM gives it: a
"thinking" block (thinking_delta events, then a signature_delta), its signature a fresh
uuid (vLLM's: nothing here checks a thinking block sent back).
"""

import json
import uuid
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator

from tinyserve.entrypoints.api.sse import sse_event
from tinyserve.entrypoints.api.guards.strict_body import StrictBody, Text
from tinyserve.entrypoints.api.tools.tool_calls import ToolCallDeltas, tool_constraint
from tinyserve.structured_output.schema_check import check_json_schema


class TextBlock(StrictBody):
    type: Literal["text"]
    text: Text


class Base64ImageSource(StrictBody):
    type: Literal["base64"]
    media_type: Literal["image/jpeg", "image/png", "image/gif", "image/webp"]
    data: Text


class URLImageSource(StrictBody):
    type: Literal["url"]
    url: Text  # file: or http(s): as the server allows (tinyserve/multimodal/media.py)


class ImageBlock(StrictBody):
    """An image in a user turn, as an image-text model takes it (tinyserve/multimodal/chat.py)."""

    type: Literal["image"]
    source: Annotated[Base64ImageSource | URLImageSource, Field(discriminator="type")]

    def as_image_part(self) -> dict:
        """OpenAI's image_url part, the one form the renderer reads."""
        source = self.source
        url = source.url if isinstance(source, URLImageSource) else f"data:{source.media_type};base64,{source.data}"
        return {"type": "image_url", "image_url": {"url": url}}


class ToolUseBlock(StrictBody):
    type: Literal["tool_use"]
    id: Text
    name: Text
    input: dict[str, Any]


class ToolResultBlock(StrictBody):
    type: Literal["tool_result"]
    tool_use_id: Text
    content: Text | list[TextBlock] = ""
    is_error: bool = False

    @property
    def text(self) -> str:
        text = self.content if isinstance(self.content, str) else "".join(block.text for block in self.content)
        return f"Error: {text}" if self.is_error else text


ContentBlock = Annotated[TextBlock | ImageBlock | ToolUseBlock | ToolResultBlock, Field(discriminator="type")]


class AnthropicTool(StrictBody):
    name: Text = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")
    description: Text | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None  # Anthropic's own server tools (web search, ...) are not served here

    @field_validator("input_schema")
    @classmethod
    def _usable_schema(cls, value):
        check_json_schema(value, "tools")
        return value


class AnthropicToolChoice(StrictBody):
    type: Literal["auto", "any", "tool", "none"]
    name: Text | None = None
    disable_parallel_tool_use: bool = False


def check_tools(tools: list[AnthropicTool] | None, tool_choice: AnthropicToolChoice | None) -> None:
    names = [tool.name for tool in tools or ()]
    if tool_choice is not None and tool_choice.type != "none" and not tools:
        raise ValueError("tool_choice needs tools: give the tools the model may use")
    if len(set(names)) != len(names):
        raise ValueError(f"tools must have distinct names, got {names}")
    if tool_choice is not None and (tool_choice.type == "tool") != (tool_choice.name is not None):
        raise ValueError('tool_choice takes a name with type "tool", and only then')
    if tool_choice is not None and tool_choice.type == "tool" and tool_choice.name not in names:
        raise ValueError(f"tool_choice names the tool {tool_choice.name!r}, which is not among the tools {names}")


def template_messages(role: str, content: str | list) -> list[dict]:
    """One Anthropic message as chat-template messages: tool results become "tool" turns, tool uses calls."""
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    text = "".join(block.text for block in content if isinstance(block, TextBlock))
    if any(isinstance(block, ImageBlock) for block in content):  # the text and the images as parts, in order
        text = [{"type": "text", "text": block.text} if isinstance(block, TextBlock) else block.as_image_part()
                for block in content if isinstance(block, (TextBlock, ImageBlock))]
    calls = [{"id": block.id, "type": "function", "function": {"name": block.name, "arguments": block.input}}
             for block in content if isinstance(block, ToolUseBlock)]
    results = [{"role": "tool", "tool_call_id": block.tool_use_id, "content": block.text}
               for block in content if isinstance(block, ToolResultBlock)]
    turns = results + ([{"role": role, "content": text}] if text or not results else [])
    if calls:
        turns[-1]["tool_calls"] = calls
    return turns


def template_tools(tools: list[AnthropicTool] | None) -> list[dict] | None:
    """As OpenAI's function tools, the shape chat templates take."""
    if not tools:
        return None
    return [{"type": "function", "function": {"name": tool.name, "description": tool.description or "",
                                              "parameters": tool.input_schema}} for tool in tools]


def tool_plan(tools, tool_choice, tool_call_parser: str | None):
    """(the output's constraint, a maker of ToolCallDeltas or None); a ValueError for "auto" with no parser."""
    choice = tool_choice.type if tool_choice is not None else "auto"
    if not tools or choice == "none":
        return None, None
    constraint_tools = [{"name": tool.name, "parameters": tool.input_schema} for tool in tools]
    if choice == "auto":
        if tool_call_parser is None:
            raise ValueError('tool_choice "auto" (the default with tools) needs the server started with '
                             '--enable-auto-tool-choice and --tool-call-parser; or give "any", "tool" or "none"')
        return None, lambda: ToolCallDeltas(tool_call_parser)
    if choice == "any":
        return (tool_constraint(constraint_tools, "required", not tool_choice.disable_parallel_tool_use),
                lambda: ToolCallDeltas("required"))
    return (tool_constraint(constraint_tools, {"name": tool_choice.name}),
            lambda: ToolCallDeltas("named", tool_choice.name))


def tool_use_id(openai_id: str) -> str:
    return "toolu_" + openai_id.removeprefix("call_")


def content_blocks(calls: ToolCallDeltas, text: str) -> list[dict]:
    """The whole reply as Anthropic content blocks: its text (if any), then a tool_use block per call."""
    message = calls.message(text)
    blocks = [{"type": "text", "text": message["content"]}] if message.get("content") else []
    for call in message.get("tool_calls") or ():
        try:
            arguments = json.loads(call["function"]["arguments"])
        except ValueError:  # a call cut short (max_tokens): its input cannot be an object; the text it had
            blocks.append({"type": "text", "text": call["function"]["arguments"]})
            continue
        blocks.append({"type": "tool_use", "id": tool_use_id(call["id"]), "name": call["function"]["name"],
                       "input": arguments})
    return blocks or [{"type": "text", "text": ""}]


def with_thinking(reasoning: str, blocks: list[dict]) -> list[dict]:
    """The reply's blocks after its reasoning's thinking block, as vLLM's: with reasoning, an empty text dropped."""
    if not reasoning:
        return blocks
    thinking = {"type": "thinking", "thinking": reasoning, "signature": uuid.uuid4().hex}
    return [thinking, *(block for block in blocks if block != {"type": "text", "text": ""})]


class BlockEvents:
    """OpenAI-shaped deltas (ToolCallDeltas.feed, an answer layer's "reasoning") as Anthropic content block events."""

    def __init__(self) -> None:
        self.index = -1
        self.open_kind: str | None = None

    def events(self, deltas: list[dict]) -> list[str]:
        events = []
        for delta in deltas:
            if delta.get("reasoning"):
                if self.open_kind != "thinking":
                    events += self._start({"type": "thinking", "thinking": ""})
                events.append(self._delta({"type": "thinking_delta", "thinking": delta["reasoning"]}))
            if delta.get("content"):
                if self.open_kind != "text":
                    events += self._start({"type": "text", "text": ""})
                events.append(self._delta({"type": "text_delta", "text": delta["content"]}))
            for call in delta.get("tool_calls") or ():
                if "id" in call:
                    events += self._start({"type": "tool_use", "id": tool_use_id(call["id"]),
                                           "name": call["function"]["name"], "input": {}})
                arguments = call["function"].get("arguments")
                if arguments:
                    events.append(self._delta({"type": "input_json_delta", "partial_json": arguments}))
        return events

    def close(self) -> list[str]:
        if self.open_kind == "closed":
            return []
        if self.open_kind is None:  # nothing was said: one empty text block, as Anthropic's API sends
            return [*self._start({"type": "text", "text": ""}), *self.close()]
        signed = [self._delta({"type": "signature_delta", "signature": uuid.uuid4().hex})] \
            if self.open_kind == "thinking" else []
        self.open_kind = "closed"
        return [*signed, sse_event("content_block_stop", {"type": "content_block_stop", "index": self.index})]

    def _start(self, block: dict) -> list[str]:
        events = [] if self.open_kind in (None, "closed") else self.close()
        self.index += 1
        self.open_kind = block["type"]
        return events + [sse_event("content_block_start", {"type": "content_block_start", "index": self.index,
                                                           "content_block": block})]

    def _delta(self, delta: dict) -> str:
        return sse_event("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta})
