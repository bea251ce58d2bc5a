"""Tool calling, vLLM's way: the model writes its calls as text, and this module reads them out.

Which tool_choice asks for what:

    "none"              tools are shown to the chat template, the reply is plain text
    "required"          the output is constrained (structured outputs) to a JSON array of calls,
                        [{"name": <one of the tools>, "parameters": <that tool's schema>}, ...],
                        so even a model that never learnt tools returns valid calls
    {"function": name}  the output is constrained to that function's parameters schema:
                        the whole output is the call's arguments
    "auto"              unconstrained; the model decides, and the server's --tool-call-parser
                        finds the calls in its text. hermes (Qwen2.5 / Qwen3, Hermes 2 Pro):
                        <tool_call>{"name": ..., "arguments": {...}}</tool_call>

`ToolCallParser` is fed the text as it arrives and gives back what may be shown now: plain
content, and each call once it is complete, so the same code answers a stream (as OpenAI
tool-call deltas) and a single response.
"""

import json
import uuid
from dataclasses import dataclass, field

from tinyserve.sampling_params import StructuredOutputsParams

TOOL_CALL_PARSERS = ("hermes",)
HERMES_START, HERMES_END = "<tool_call>", "</tool_call>"


@dataclass(slots=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def as_openai(self, index: int | None = None) -> dict:
        call = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


def required_calls_schema(tools: list[dict], parallel_tool_calls: bool = True) -> dict:
    """The JSON schema of tool_choice "required": a non-empty array of calls to the given tools.

    tools: [{"name": ..., "parameters": <JSON schema>}].
    """
    call = {"anyOf": [{
        "type": "object",
        "properties": {"name": {"enum": [tool["name"]]}, "parameters": tool["parameters"]},
        "required": ["name", "parameters"],
        "additionalProperties": False,
    } for tool in tools]}
    schema = {"type": "array", "minItems": 1, "items": call}
    if not parallel_tool_calls:
        schema["maxItems"] = 1
    return schema


def tool_constraint(tools: list[dict], tool_choice, parallel_tool_calls: bool = True) -> StructuredOutputsParams | None:
    """The constraint a tool_choice puts on the output: "required" or {"name": ...} (a named function)."""
    if tool_choice == "required":
        return StructuredOutputsParams(json=required_calls_schema(tools, parallel_tool_calls))
    if isinstance(tool_choice, dict):
        [tool] = [tool for tool in tools if tool["name"] == tool_choice["name"]]
        return StructuredOutputsParams(json=tool["parameters"])
    return None


class ToolCallParser:
    """Reads tool calls out of the output text, as it arrives (`feed`), until it ends (`finish`).

    mode: "required" (a JSON array of calls), "named" (the text is one call's arguments) or
    "hermes" (<tool_call> blocks among plain text).
    """

    def __init__(self, mode: str, function_name: str | None = None) -> None:
        self.mode = mode
        self.function_name = function_name
        self.text = ""
        self.num_calls = 0
        self._position = 0  # required: where the next array element starts; hermes: where unread text starts

    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        """(content that may be shown now, calls complete now) after `delta` is added to the text."""
        self.text += delta
        if self.mode == "required":
            return "", self._complete_elements()
        if self.mode == "hermes":
            return self._hermes(final=False)
        return "", []  # named: the arguments are streamed as they come (see named_call)

    def finish(self) -> tuple[str, list[ToolCall]]:
        """What is left once the output has ended."""
        if self.mode == "named":
            return "", [ToolCall(self.function_name, self.text)]
        if self.mode == "hermes":
            return self._hermes(final=True)
        return "", []

    def _complete_elements(self) -> list[ToolCall]:
        calls = []
        decoder = json.JSONDecoder()
        while True:
            rest = self.text[self._position:]
            skipped = len(rest) - len(rest.lstrip(" \n\t[,"))
            start = self._position + skipped
            try:
                element, end = decoder.raw_decode(self.text, start)
            except ValueError:  # not complete yet (or the array has ended)
                return calls
            self._position = end
            calls.append(ToolCall(element["name"], json.dumps(element["parameters"], ensure_ascii=False)))
            self.num_calls += 1

    def _hermes(self, final: bool) -> tuple[str, list[ToolCall]]:
        content, calls = "", []
        while True:
            rest = self.text[self._position:]
            start = rest.find(HERMES_START)
            if start < 0:
                # Hold back a tail that may be the start of "<tool_call>", until the next text says.
                keep = 0 if final else _partial_suffix(rest, HERMES_START)
                content += rest[: len(rest) - keep]
                self._position += len(rest) - keep
                return content, calls
            content += rest[:start]
            end = rest.find(HERMES_END, start)
            if end < 0:
                if final:  # never closed: it was text after all
                    content += rest[start:]
                    self._position = len(self.text)
                else:
                    self._position += start
                return content, calls
            call = _hermes_call(rest[start + len(HERMES_START): end])
            if call is None:
                content += rest[start: end + len(HERMES_END)]
            else:
                calls.append(call)
                self.num_calls += 1
            self._position += end + len(HERMES_END)


def _hermes_call(body: str) -> ToolCall | None:
    try:
        call = json.loads(body)
        name, arguments = call["name"], call.get("arguments", {})
    except (ValueError, TypeError, KeyError):
        return None
    if not isinstance(name, str):
        return None
    return ToolCall(name, arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False))


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that is a beginning of `marker`."""
    for length in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-length:]):
            return length
    return 0


def tools_for_constraint(tools) -> list[dict]:
    """[{"name", "parameters"}] of the request's Tool models."""
    return [{"name": tool.function.name, "parameters": tool.function.parameters_schema} for tool in tools]


class ToolCallDeltas:
    """One choice's text deltas as OpenAI chat deltas: {"content": ...} and {"tool_calls": [...]}.

    A named function's arguments stream as they are generated (the call's id and name first);
    other calls are sent whole, each once its text is complete.
    """

    def __init__(self, mode: str, function_name: str | None = None) -> None:
        self.parser = ToolCallParser(mode, function_name)
        self.named = ToolCall(function_name, "") if mode == "named" else None
        self.calls: list[ToolCall] = []

    def feed(self, text: str, finished: bool) -> list[dict]:
        if self.named is not None:
            deltas = []
            if not self.calls:
                self.calls.append(self.named)
                deltas.append({"tool_calls": [self.named.as_openai(0)]})
            if text:
                self.named.arguments += text
                deltas.append({"tool_calls": [{"index": 0, "function": {"arguments": text}}]})
            return deltas
        content, calls = self.parser.feed(text)
        if finished:
            more_content, more_calls = self.parser.finish()
            content, calls = content + more_content, calls + more_calls
        deltas = [{"content": content}] if content else []
        for call in calls:
            deltas.append({"tool_calls": [call.as_openai(len(self.calls))]})
            self.calls.append(call)
        return deltas

    def message(self, text: str) -> dict:
        """The whole reply at once: {"content", "tool_calls"} of a chat.completion's message."""
        content = "".join(delta.get("content", "") for delta in self.feed(text, finished=True))
        calls = [call.as_openai() for call in self.calls]
        return {"content": content or None, "tool_calls": calls} if calls else {"content": content}

    def finish_reason(self, finish_reason: str | None) -> str | None:
        """"tool_calls" when the reply ended (on its own) having made calls."""
        return "tool_calls" if finish_reason == "stop" and self.calls else finish_reason
