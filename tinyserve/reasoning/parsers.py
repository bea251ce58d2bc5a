"""ThinkingReader: one choice's text as its reasoning and its content, split at <think> and </think>.

The text comes in the pieces the detokenizer made (one per engine output, streamed) or
whole; either way it goes through the same few states, so a stream's pieces add up to the
whole answer's split:

    reasoning   "<think>" is dropped; "</think>" is dropped and the content starts; with qwen3 a
                "<tool_call>" starts the content too, and stays in it (the call is content's)
    content     the rest, as it is; qwen3 drops a second "</think>" there too

Where the reasoning starts (vLLM's rules, `reasoning_open`):

    deepseek_r1   in reasoning, unless the prompt's last <think> or </think> is a </think>
    qwen3         in content with chat_template_kwargs {"enable_thinking": false}; otherwise in
                  reasoning, unless the prompt's last turn (after <|im_start|> or <|im_end|>) holds
                  a </think> after any <think>

An answer that never leaves its reasoning is all reasoning (content null), as in vLLM. A piece
that ends with the start of a marker ("</thi") holds that end back until the next piece says
what it is. The reasoning tokens (usage's reasoning_tokens) are counted on the token ids by
the same rules: the tokens read in reasoning, less the markers. (vLLM's deepseek_r1 counts
only tokens between a <think> and a </think> both in the output, so 0 where the template put
the <think> in the prompt; here they are the reasoning's tokens either way.)
"""

from dataclasses import dataclass

THINK_START, THINK_END = "<think>", "</think>"
QWEN3_TOOL_CALL = "<tool_call>"  # Qwen3's tool calls end the reasoning (vLLM's implicit reasoning end)
QWEN3_TURN_BOUNDARIES = ("<|im_start|>", "<|im_end|>")


@dataclass(frozen=True, slots=True)
class ParserRules:
    """What a --reasoning-parser name means."""

    name: str
    implicit_end: str | None = None  # a marker that ends the reasoning and stays in the content
    drops_end_in_content: bool = False  # a second </think> in the content is dropped
    turn_boundaries: tuple[str, ...] = ()  # the prompt's last turn starts after one of these (qwen3)
    thinking_switch: bool = False  # chat_template_kwargs' enable_thinking false starts in content


REASONING_PARSERS = {
    "deepseek_r1": ParserRules("deepseek_r1"),
    "qwen3": ParserRules("qwen3", implicit_end=QWEN3_TOOL_CALL, drops_end_in_content=True,
                         turn_boundaries=QWEN3_TURN_BOUNDARIES, thinking_switch=True),
}


@dataclass(frozen=True, slots=True)
class MarkerIds:
    """The markers' token ids in the served tokenizer (None: the marker is not one token there)."""

    start: int
    end: int
    implicit_end: int | None = None
    turn_boundaries: frozenset[int] = frozenset()

    @classmethod
    def of(cls, rules: ParserRules, vocab: dict[str, int]) -> "MarkerIds":
        missing = [marker for marker in (THINK_START, THINK_END) if marker not in vocab]
        if missing:
            raise ValueError(f"--reasoning-parser {rules.name}: the tokenizer has no token {missing[0]!r}: its "
                             f"reasoning is marked by {THINK_START} and {THINK_END}, each one token")
        return cls(vocab[THINK_START], vocab[THINK_END], vocab.get(rules.implicit_end) if rules.implicit_end else None,
                   frozenset(vocab[b] for b in rules.turn_boundaries if b in vocab))


def reasoning_open(rules: ParserRules, ids: MarkerIds, prompt_token_ids: list[int],
                   template_kwargs: dict | None) -> bool:
    """Whether the answer starts in its reasoning, by the parser's rules (the module's docstring)."""
    if rules.thinking_switch and (template_kwargs or {}).get("enable_thinking", True) is False:
        return False
    if rules.turn_boundaries and not ids.turn_boundaries:
        return True  # no turn to look in: vLLM's qwen3 then never reads the prompt
    ends = {ids.end} | ({ids.implicit_end} if ids.implicit_end is not None else set())
    for token_id in reversed(prompt_token_ids):
        if token_id in ends:
            return False
        if token_id == ids.start or token_id in ids.turn_boundaries:
            return True
    return True


class ThinkingReader:
    """One choice's pieces of text in, its reasoning and content deltas out (`read`); `num_reasoning_tokens`."""

    def __init__(self, rules: ParserRules, ids: MarkerIds, in_reasoning: bool) -> None:
        self.rules, self.ids = rules, ids
        self.in_reasoning = in_reasoning  # where the text read so far ends
        self._ids_in_reasoning = in_reasoning  # the same, read on the token ids (the count's)
        self._held = ""  # the start of a possible marker, not given out yet
        self.num_reasoning_tokens = 0
        self.ended_at: int | None = None  # how many tokens had been read when the reasoning ended
        self._num_tokens = 0

    def read(self, text: str, token_ids: list[int], finished: bool) -> list[dict]:
        """The piece's deltas, [{"reasoning": ...}, {"content": ...}] in the order they come. A piece without
        text (the detokenizer held a half character back) is one empty delta of where the text is, as vLLM's
        stream sends it; one that was only a marker gives none."""
        self._count(token_ids)
        if not text and not (finished and self._held):
            return [] if finished else [{self._kind: ""}]
        deltas: list[dict] = []
        rest, self._held = self._held + text, ""
        while rest:
            position, marker = self._next_marker(rest)
            if marker is None:
                keep = 0 if finished else self._partial_marker(rest)
                self._give(deltas, rest[:len(rest) - keep])
                self._held = rest[len(rest) - keep:]
                break
            self._give(deltas, rest[:position])
            if marker == self.rules.implicit_end and self.in_reasoning:
                self.in_reasoning = False
                self._give(deltas, marker)
            elif marker == THINK_END:
                self.in_reasoning = False
            rest = rest[position + len(marker):]
        return deltas

    @property
    def _kind(self) -> str:
        return "reasoning" if self.in_reasoning else "content"

    def _markers(self) -> tuple[str, ...]:
        if self.in_reasoning:
            return (THINK_START, THINK_END) + ((self.rules.implicit_end,) if self.rules.implicit_end else ())
        return (THINK_END,) if self.rules.drops_end_in_content else ()

    def _next_marker(self, text: str) -> tuple[int, str | None]:
        found = [(text.find(marker), marker) for marker in self._markers() if marker in text]
        return min(found) if found else (-1, None)

    def _partial_marker(self, text: str) -> int:
        """The length of the longest end of `text` that begins a marker."""
        longest = 0
        for marker in self._markers():
            for length in range(min(len(text), len(marker) - 1), longest, -1):
                if marker.startswith(text[-length:]):
                    longest = length
                    break
        return longest

    def _give(self, deltas: list[dict], text: str) -> None:
        if not text:
            return
        if deltas and self._kind in deltas[-1]:
            deltas[-1][self._kind] += text
        else:
            deltas.append({self._kind: text})

    def _count(self, token_ids: list[int]) -> None:
        ids = self.ids
        for token_id in token_ids:
            self._num_tokens += 1
            if not self._ids_in_reasoning:
                continue
            if token_id == ids.end or (token_id == ids.implicit_end and ids.implicit_end is not None):
                self._ids_in_reasoning = False
                self.ended_at = self._num_tokens
            elif token_id != ids.start:
                self.num_reasoning_tokens += 1


def split(reader: ThinkingReader, text: str, token_ids: list[int]) -> tuple[str | None, str | None]:
    """A whole answer as (reasoning, content), each None when empty, as vLLM's message gives them."""
    deltas = reader.read(text, token_ids, finished=True)
    reasoning = "".join(d.get("reasoning", "") for d in deltas)
    content = "".join(d.get("content", "") for d in deltas)
    return reasoning or None, content or None
