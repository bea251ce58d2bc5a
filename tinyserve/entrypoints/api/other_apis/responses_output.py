"""A response's output items, built from the reply as it arrives, and the stream events that build them.

The reply comes as chat deltas (tool_calls.ToolCallDeltas: {"content"} and {"tool_calls"}; with
a reasoning parser, {"reasoning"} first, tinyserve/reasoning/); each kind opens an item of its
own, and an item is closed when the next one opens or the reply ends:

    reasoning   reasoning      output_item.added, content_part.added
                               reasoning_text.delta ...
                               reasoning_text.done, content_part.done, output_item.done
    text        message        output_item.added, content_part.added
                               output_text.delta ...
                               output_text.done, content_part.done, output_item.done
    a call      function_call  output_item.added (its call_id and name, no arguments yet)
                               function_call_arguments.delta ...
                               function_call_arguments.done, output_item.done

A reply of nothing is one empty message, as OpenAI's API gives. A single response is built the
same way, its events unused, so the two cannot disagree. With include ["message.output_text.logprobs"],
each token's logprobs (chat's shape: token, logprob, bytes, top_logprobs) go with the text delta that
carries it, and into the output_text part; a token whose text is held back (half a character) has
its logprobs go with the next text. The item still open when the reply is
cut short (max_output_tokens) is "incomplete"; the others are "completed".
"""

import uuid


class OutputItems:
    """The output items so far (`items`); `feed` and `close` give the events, as (type, payload) pairs."""

    def __init__(self) -> None:
        self.items: list[dict] = []
        self._open: dict | None = None
        self._pending_logprobs: list[dict] = []  # of tokens whose text has not come yet

    @property
    def text(self) -> str:
        """The reply's text, over all its messages."""
        return "".join(item["content"][0]["text"] for item in self.items if item["type"] == "message")

    @property
    def calls(self) -> list[dict]:
        return [item for item in self.items if item["type"] == "function_call"]

    def feed(self, deltas: list[dict], logprobs: list[dict] | None = None) -> list[tuple[str, dict]]:
        """logprobs: those of the tokens the deltas were read from (include's message.output_text.logprobs)."""
        events = []
        self._pending_logprobs += logprobs or []
        for delta in deltas:
            if delta.get("reasoning"):
                if self._open is None or self._open["type"] != "reasoning":
                    events += self._start(_reasoning())
                self._open["content"][0]["text"] += delta["reasoning"]
                events.append(("response.reasoning_text.delta", {**self._where(content_index=0),
                                                                 "delta": delta["reasoning"]}))
            if delta.get("content"):
                if self._open is None or self._open["type"] != "message":
                    events += self._start(_message())
                part = self._open["content"][0]
                part["text"] += delta["content"]
                given, self._pending_logprobs = self._pending_logprobs, []
                part["logprobs"] += given
                events.append(("response.output_text.delta", {**self._where(content_index=0),
                                                              "delta": delta["content"], "logprobs": given}))
            for call in delta.get("tool_calls") or ():
                if "id" in call:
                    events += self._start({"type": "function_call", "id": f"fc_{uuid.uuid4().hex}",
                                           "call_id": call["id"], "name": call["function"]["name"],
                                           "arguments": "", "status": "in_progress"})
                arguments = call["function"].get("arguments")
                if arguments:
                    self._open["arguments"] += arguments
                    events.append(("response.function_call_arguments.delta", {**self._where(), "delta": arguments}))
        return events

    def close(self, status: str = "completed") -> list[tuple[str, dict]]:
        """End the open item with `status` (an empty message if none was opened)."""
        events = self._start(_message()) if not self.items else []
        item, self._open = self._open, None
        if item is None:
            return events
        item["status"] = status
        where = {"item_id": item["id"], "output_index": len(self.items) - 1}
        if item["type"] == "message":
            part = item["content"][0]
            part["logprobs"] += self._pending_logprobs  # tokens whose text never came (an unfinished character)
            self._pending_logprobs = []
            events += [("response.output_text.done", {**where, "content_index": 0, "text": part["text"],
                                                      "logprobs": list(part["logprobs"])}),
                       ("response.content_part.done", {**where, "content_index": 0, "part": dict(part)})]
        elif item["type"] == "reasoning":
            part = item["content"][0]
            events += [("response.reasoning_text.done", {**where, "content_index": 0, "text": part["text"]}),
                       ("response.content_part.done", {**where, "content_index": 0, "part": dict(part)})]
        else:
            events.append(("response.function_call_arguments.done", {**where, "name": item["name"],
                                                                     "arguments": item["arguments"]}))
        return events + [("response.output_item.done", {"output_index": where["output_index"], "item": _copy(item)})]

    def _start(self, item: dict) -> list[tuple[str, dict]]:
        events = self.close() if self._open is not None else []
        self.items.append(item)
        self._open = item
        parted = item["type"] in ("message", "reasoning")
        added = {**item, "content": []} if parted else dict(item)  # its part comes next
        events.append(("response.output_item.added", {"output_index": len(self.items) - 1, "item": added}))
        if parted:
            events.append(("response.content_part.added", {**self._where(content_index=0),
                                                           "part": dict(item["content"][0])}))
        return events

    def _where(self, **more) -> dict:
        return {"item_id": self._open["id"], "output_index": len(self.items) - 1, **more}


def _message() -> dict:
    return {"type": "message", "id": f"msg_{uuid.uuid4().hex}", "status": "in_progress", "role": "assistant",
            "content": [{"type": "output_text", "text": "", "annotations": [], "logprobs": []}]}


def _reasoning() -> dict:
    return {"type": "reasoning", "id": f"rs_{uuid.uuid4().hex}", "status": "in_progress", "summary": [],
            "content": [{"type": "reasoning_text", "text": ""}]}


def _copy(item: dict) -> dict:
    """The item as it is now (later deltas change the original)."""
    copy = dict(item)
    if "content" in copy:
        copy["content"] = [{**part, **({"logprobs": list(part["logprobs"])} if "logprobs" in part else {})}
                           for part in copy["content"]]
    return copy
