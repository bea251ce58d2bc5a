"""tool_choice "required", streamed: each call's name, then its arguments in pieces, as generated.

The output of a "required" tool choice is constrained (tool_calls.required_calls_schema) to
[{"name": ..., "parameters": {...}}, ...]: so a call's name is known once its string closes,
and its arguments are the parameters' JSON text as far as it has come. vLLM streams these
calls so, as it streams a named function's arguments; RequiredCallsStream reads them.
"""

import json
import re
from collections.abc import Callable

_REQUIRED_CALL_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"parameters"\s*:\s*(?=\S)')


def json_value_end(text: str, start: int) -> int | None:
    """Where the JSON value at text[start] ends (the index after it), or None while it is incomplete.

    Written for the arguments of a constrained call, which are well-formed as far as they go:
    an object or array is closed by its matching bracket (strings and escapes skipped), a
    string by its closing quote; a bare literal (a number, true) has no end until a
    separator follows it."""
    depth, in_string, escaped = 0, False, False
    for index in range(start, len(text)):
        char = text[index]
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
                if depth == 0:
                    return index + 1
        elif char == '"':
            in_string = True
        elif char in "{[":
            depth += 1
        elif char in "}]":
            depth -= 1
            if depth <= 0:
                return index + 1 if depth == 0 else index
        elif depth == 0 and char in ", \n\t":
            return index
    return None


class RequiredCallsStream:
    """tool_choice "required", read as it is generated: the output is constrained to
    [{"name": ..., "parameters": {...}}, ...], so each call's name is known once its string
    closes, and its arguments are the parameters' JSON text as far as it has come. `feed`
    gives OpenAI tool-call deltas: a call's id and name first, then its arguments in pieces,
    as a named function's are (and as vLLM streams both). A call cut short (max_tokens) keeps
    the arguments generated so far."""

    def __init__(self, make_call: Callable[[str], object]) -> None:
        """make_call(name): a new call with empty arguments (tool_calls.ToolCall: .arguments, .as_openai)."""
        self.make_call = make_call
        self.text = ""
        self.calls: list = []
        self._next = 0  # where the next call may start
        self._arguments_start: int | None = None  # the current call's arguments, once its name is known
        self._sent = 0  # how far the current call's arguments have been sent

    def feed(self, delta: str) -> list[dict]:
        self.text += delta
        deltas = []
        while True:
            if self._arguments_start is None:
                head = _REQUIRED_CALL_HEAD.match(self.text, self._next + self._skip(self._next))
                if head is None:
                    return deltas
                self.calls.append(self.make_call(json.loads(head.group(1))))
                deltas.append({"tool_calls": [self.calls[-1].as_openai(len(self.calls) - 1)]})
                self._arguments_start = self._sent = head.end()
            end = json_value_end(self.text, self._arguments_start)
            upto = len(self.text) if end is None else end
            if upto > self._sent:
                piece = self.text[self._sent:upto]
                self.calls[-1].arguments += piece
                deltas.append({"tool_calls": [{"index": len(self.calls) - 1, "function": {"arguments": piece}}]})
                self._sent = upto
            if end is None:
                return deltas
            close = self.text.find("}", end)  # the call object's own closing brace
            if close < 0:
                return deltas
            self._next, self._arguments_start = close + 1, None

    def _skip(self, start: int) -> int:
        """How many characters between calls (the array's bracket, commas, spaces) from start on."""
        rest = self.text[start:]
        return len(rest) - len(rest.lstrip(" \n\t[,"))
