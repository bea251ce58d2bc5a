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
                        llama3_json (Llama 3.1 / 3.2): a reply that is JSON, an object per call,
                        [<|python_tag|>]{"name": ..., "parameters": {...}}; {...}

`ToolCallParser` is fed the text as it arrives and gives back what may be shown now: plain
content, and each call once it is complete, so the same code answers a stream (as OpenAI
tool-call deltas) and a single response.
"""

import json
import uuid
from dataclasses import dataclass, field

from tinyserve.entrypoints.api.tools.required_calls import RequiredCallsStream
from tinyserve.sampling_params import StructuredOutputsParams

TOOL_CALL_PARSERS = ("hermes", "llama3_json")
HERMES_START, HERMES_END = "<tool_call>", "</tool_call>"
LLAMA3_PYTHON_TAG = "<|python_tag|>"  # Llama 3's token before a tool call, when it is not skipped


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

    mode: "named" (the text is one call's arguments), "hermes" (<tool_call> blocks among plain
    text) or "llama3_json" (JSON calls, or plain text). "required" is RequiredCallsStream's.
    """

    def __init__(self, mode: str, function_name: str | None = None) -> None:
        self.mode = mode
        self.function_name = function_name
        self.text = ""
        self.num_calls = 0
        self._position = 0  # llama3_json: where the next call starts; hermes: where unread text starts
        self._llama3_calls: bool | None = None  # llama3_json: whether the reply is calls, once its start says

    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        """(content that may be shown now, calls complete now) after `delta` is added to the text."""
        self.text += delta
        if self.mode == "hermes":
            return self._hermes(final=False)
        if self.mode == "llama3_json":
            return self._llama3(final=False)
        return "", []  # named: the arguments are streamed as they come (see named_call)

    def finish(self) -> tuple[str, list[ToolCall]]:
        """What is left once the output has ended."""
        if self.mode == "named":
            return "", [ToolCall(self.function_name, self.text)]
        if self.mode == "hermes":
            return self._hermes(final=True)
        if self.mode == "llama3_json":
            return self._llama3(final=True)
        return "", []

    def _json_calls(self, separators: str, final: bool) -> tuple[str, list[ToolCall]]:
        """The JSON objects complete from _position on, as calls; what is not a call is content."""
        content, calls = "", []
        decoder = json.JSONDecoder()
        while True:
            rest = self.text[self._position:]
            start = self._position + len(rest) - len(rest.lstrip(separators))
            try:
                element, end = decoder.raw_decode(self.text, start)
            except ValueError:  # not complete yet (or the calls have ended)
                if final and self.mode == "llama3_json":
                    content, self._position = content + self.text[self._position:], len(self.text)
                return content, calls
            call = _call_from(element)
            if call is None:
                content += self.text[self._position:end]
            else:
                calls.append(call)
                self.num_calls += 1
            self._position = end

    def _llama3(self, final: bool) -> tuple[str, list[ToolCall]]:
        if self._llama3_calls is None:  # a reply is calls if it opens with the python tag or "{"
            head = self.text.lstrip()
            if not final and (not head or LLAMA3_PYTHON_TAG.startswith(head)):
                return "", []  # too early to say
            self._llama3_calls = head.startswith((LLAMA3_PYTHON_TAG, "{"))
            if self._llama3_calls:
                self._position = len(self.text) - len(head) + (len(LLAMA3_PYTHON_TAG) * head.startswith(
                    LLAMA3_PYTHON_TAG))
        if self._llama3_calls:
            return self._json_calls(" \n\t;,", final)
        content, self._position = self.text[self._position:], len(self.text)
        return content, []

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
            try:
                call = _call_from(json.loads(rest[start + len(HERMES_START): end]))
            except ValueError:
                call = None
            if call is None:
                content += rest[start: end + len(HERMES_END)]
            else:
                calls.append(call)
                self.num_calls += 1
            self._position += end + len(HERMES_END)


def _call_from(element) -> ToolCall | None:
    """{"name": ..., "arguments" or "parameters": {...}} as a call; anything else None."""
    if not isinstance(element, dict) or not isinstance(element.get("name"), str):
        return None
    arguments = element.get("arguments", element.get("parameters", {}))
    return ToolCall(element["name"],
                    arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False))


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

    A named function's arguments, and each call of a "required" choice, stream as they are
    generated (the call's id and name first, RequiredCallsStream); calls read out of free text
    ("auto") are sent whole, each once its text is complete. Without parallel_tool_calls, calls
    after the first are dropped (a "required" one is constrained to one call already).
    """

    def __init__(self, mode: str, function_name: str | None = None, parallel_tool_calls: bool = True) -> None:
        self.parser = ToolCallParser(mode, function_name)
        self.named = ToolCall(function_name, "") if mode == "named" else None
        self.required = RequiredCallsStream(lambda name: ToolCall(name, "")) if mode == "required" else None
        self.parallel_tool_calls = parallel_tool_calls
        self.calls: list[ToolCall] = []

    def feed(self, text: str, finished: bool) -> list[dict]:
        if self.required is not None:
            deltas = self.required.feed(text)
            self.calls = self.required.calls
            if finished and not self.calls and self.required.text:  # cut before a call's name: the text itself
                deltas.append({"content": self.required.text})
            return deltas
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
        if not self.parallel_tool_calls:
            calls = calls[:max(0, 1 - len(self.calls))]
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
