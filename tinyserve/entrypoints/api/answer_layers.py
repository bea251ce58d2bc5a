"""The seam between the API's answers and the layers that read them (stage ⑨), as engine/layers.py is the engine's.

A capability that reads the model's output in the API process before it is answered (the
reasoning parser, tinyserve/reasoning/) is an AnswerLayer: a package with the layer in its
`layer.py`, listed in tinyserve/assemble.py's ANSWER_LAYERS; `tinyserve serve` builds each
one its flags enable (`from_flags`) and hands them to the handlers in one AnswerLayers. The
chat, Responses and Anthropic messages handlers ask it, per request:

    template_kwargs   the chat template's variables, given the request's own and its effort
    reading           once the prompt is rendered: a Reading of the request's choices, or an
                      APIError (a 400 naming a field the layer cannot honour with this prompt)

the Reading, for the engine request (the handler passes it to AsyncLLM.add_request):

    reasoning_end     where a constraint's grammar starts: after the reasoning a layer reads
                      (wire/messages.py's ReasoningEnd, vLLM's way), or None: at the first token

and the Reading, per choice, for a ChoiceReader:

    read(text, token_ids, finished)   the choice's new text as message deltas: {"content": ...},
                                      and the layers' own ({"reasoning": ...}); each layer reads
                                      the content the ones before it left
    message_fields()                  what the whole message adds ({"reasoning": ...})
    usage_details()                   what the usage's completion_tokens_details add
    finish(spans)                     the request's span attributes, once every choice is read

The completions handler asks only for `reasoning_end` (AnswerLayers.reasoning_end): as vLLM's, its
text is the model's whole text, no layer reads it, yet a constraint starts where vLLM's engine
starts it (after the reasoning a prompt left open).

With no layer enabled a choice's text is its content, unchanged: the handlers have one path.
"""

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ReadingRequest:
    """What a layer may read of a request when its answer's reading starts."""

    prompt_token_ids: list[int]
    template_kwargs: dict | None  # as the template got them (AnswerLayers.template_kwargs')
    include_reasoning: bool = True  # vLLM's: False leaves the reasoning out of the answer
    constrained_field: str | None = None  # the field a constraint on the output came from (response_format, ...)


class AnswerLayer:
    """One layer's part; every method's default adds nothing."""

    name = "answer layer"

    def template_kwargs(self, kwargs: dict | None, effort: str | None) -> dict | None:
        return kwargs

    def reading(self, request: ReadingRequest) -> "LayerReading | None":
        return None


class LayerReading:
    """One layer's reading of one request: a reader per choice, and what it records at the end."""

    reasoning_end = None  # a ReasoningEnd: the engine starts a constraint after it (the module's docstring)

    def choice(self):
        """A reader with read(text, token_ids, finished) -> deltas, message_fields() and usage_details()."""
        raise NotImplementedError

    def finish(self, readers: list, spans) -> None:
        """Record on the request's spans what the readers (one per choice, in order) found."""


class ChoiceReader:
    """One choice read by every layer in turn; its text is its content where no layer takes it."""

    def __init__(self, readers: list) -> None:
        self.readers = readers

    def read(self, text: str, token_ids: list[int], finished: bool) -> list[dict]:
        deltas = [{"content": text}]
        for reader in self.readers:
            deltas = [out for delta in deltas for out in
                      (reader.read(delta["content"], token_ids, finished) if "content" in delta else [delta])]
        return deltas

    def message_fields(self) -> dict:
        return {name: value for reader in self.readers for name, value in reader.message_fields().items()}

    def usage_details(self) -> dict:
        return {name: value for reader in self.readers for name, value in reader.usage_details().items()}


class Reading:
    """The layers' readings of one request's answer: `choice()` for each choice, `finish(spans)` at its end."""

    def __init__(self, readings: list[LayerReading]) -> None:
        self.readings = readings
        self.choices: list[ChoiceReader] = []

    @property
    def reasoning_end(self):
        """The first layer's ReasoningEnd (None: a constraint applies from the first token)."""
        return next((r.reasoning_end for r in self.readings if r.reasoning_end is not None), None)

    def choice(self) -> ChoiceReader:
        reader = ChoiceReader([reading.choice() for reading in self.readings])
        self.choices.append(reader)
        return reader

    def usage_details(self) -> dict:
        """completion_tokens_details: each detail summed over the choices ({} with no layer)."""
        total: dict = {}
        for reader in self.choices:
            for name, value in reader.usage_details().items():
                total[name] = total.get(name, 0) + value
        return total

    def finish(self, spans) -> None:
        for i, reading in enumerate(self.readings):
            reading.finish([choice.readers[i] for choice in self.choices], spans)


class AnswerLayers:
    """The enabled answer layers of a server, in ANSWER_LAYERS' order (none: answers are the model's text)."""

    def __init__(self, layers: list[AnswerLayer] | None = None) -> None:
        self.layers = list(layers or ())

    def template_kwargs(self, kwargs: dict | None, effort: str | None = None) -> dict | None:
        for layer in self.layers:
            kwargs = layer.template_kwargs(kwargs, effort)
        return kwargs

    def reading(self, request: ReadingRequest) -> Reading:
        return Reading([r for layer in self.layers if (r := layer.reading(request)) is not None])

    def reasoning_end(self, request: ReadingRequest):
        """Where a constraint starts, for a handler whose text no layer reads (completions): a ReasoningEnd,
        or None (from the first token)."""
        return self.reading(request).reasoning_end


def build_answer_layers(classes: list[Callable], flags, tokenizer) -> AnswerLayers:
    """Each layer class's `from_flags(flags, tokenizer)` (None: not enabled), in order."""
    return AnswerLayers([layer for cls in classes if (layer := cls.from_flags(flags, tokenizer)) is not None])
