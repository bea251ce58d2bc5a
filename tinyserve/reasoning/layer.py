"""The reasoning parser as a layer of the API's answers (`--reasoning-parser deepseek_r1|qwen3`), at its seam.

    from_flags        the parser's rules and its markers' token ids, checked against the tokenizer
                      when the server starts (a marker that is not one token: the server does not start)
    template_kwargs   a request's reasoning effort, as vLLM renders it: `reasoning_effort`, and
                      `enable_thinking` (false for "none") unless chat_template_kwargs set it
    reading           where each choice starts (parsers.reasoning_open); with a constraint on the output
                      (response_format, structured_outputs, a required or named tool_choice, text.format)
                      and the reasoning open, the reasoning's end for the engine (ReasoningEnd): as in
                      vLLM the model reasons freely and the grammar starts after </think> (engine/
                      structured_output.py). A prompt that closed the reasoning (enable_thinking false)
                      is constrained from the first token, as in vLLM.
    choice            a ThinkingReader: {"reasoning"} and {"content"} deltas; the message's `reasoning`
                      (vLLM 0.33's name; null when include_reasoning is false); usage's reasoning_tokens
    finish            the tinyserve.reasoning span (lifecycle/schema.py's REASONING_*): the parser, and per
                      choice its reasoning tokens and the output token the reasoning ended at (-1: never)

The handlers meet it through entrypoints/api/answer_layers.py only; the engine sees only the end's token ids.
"""

from tinyserve.entrypoints.api.answer_layers import AnswerLayer, LayerReading, ReadingRequest
from tinyserve.reasoning.parsers import REASONING_PARSERS, MarkerIds, ParserRules, ThinkingReader, reasoning_open
from tinyserve.wire.messages import ReasoningEnd


class ReasoningLayer(AnswerLayer):
    name = "reasoning"

    def __init__(self, rules: ParserRules, ids: MarkerIds) -> None:
        self.rules, self.ids = rules, ids

    @classmethod
    def from_flags(cls, flags, tokenizer) -> "ReasoningLayer | None":
        name = getattr(flags, "reasoning_parser", None)
        if name is None:
            return None
        rules = REASONING_PARSERS[name]
        return cls(rules, MarkerIds.of(rules, tokenizer.get_vocab()))

    def template_kwargs(self, kwargs: dict | None, effort: str | None) -> dict | None:
        if effort is None:
            return kwargs
        given = kwargs or {}
        return {"reasoning_effort": effort, "enable_thinking": effort != "none", **given}

    def reading(self, request: ReadingRequest) -> "ReasoningReading":
        starts_open = reasoning_open(self.rules, self.ids, request.prompt_token_ids, request.template_kwargs)
        end = None
        if starts_open and request.constrained_field is not None:  # the grammar starts after </think>
            implicit = self.ids.implicit_end
            end = ReasoningEnd([self.ids.end], [] if implicit is None else [implicit])
        return ReasoningReading(self, starts_open, request.include_reasoning, end)


class ReasoningReading(LayerReading):
    def __init__(self, layer: ReasoningLayer, starts_open: bool, include_reasoning: bool,
                 reasoning_end: ReasoningEnd | None) -> None:
        self.layer, self.starts_open, self.include_reasoning = layer, starts_open, include_reasoning
        self.reasoning_end = reasoning_end

    def choice(self) -> "_ChoiceReasoning":
        return _ChoiceReasoning(ThinkingReader(self.layer.rules, self.layer.ids, self.starts_open),
                                self.include_reasoning)

    def finish(self, readers: list, spans) -> None:
        spans.reasoning_read(self.layer.rules.name, [r.thinking.num_reasoning_tokens for r in readers],
                             [-1 if r.thinking.ended_at is None else r.thinking.ended_at for r in readers])


class _ChoiceReasoning:
    """A ThinkingReader as the seam reads it: the reasoning kept for the message, left out unless included."""

    def __init__(self, thinking: ThinkingReader, include_reasoning: bool) -> None:
        self.thinking, self.include_reasoning = thinking, include_reasoning
        self.reasoning = ""

    def read(self, text: str, token_ids: list[int], finished: bool) -> list[dict]:
        deltas = self.thinking.read(text, token_ids, finished)
        self.reasoning += "".join(delta.get("reasoning", "") for delta in deltas)
        if not self.include_reasoning:
            deltas = [delta for delta in deltas if "reasoning" not in delta]
        return deltas

    def message_fields(self) -> dict:
        return {"reasoning": (self.reasoning or None) if self.include_reasoning else None}

    def usage_details(self) -> dict:
        return {"reasoning_tokens": self.thinking.num_reasoning_tokens}
