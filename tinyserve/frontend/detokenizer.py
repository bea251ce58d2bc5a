"""Incremental detokenization: new token ids in, new text out, stop strings cut.

Stage ⑧ of a request's journey. The engine sends back token ids a few at a time; the
output processor in the API process feeds them to the request's IncrementalDetokenizer
and streams the text deltas it returns to the client.

Turning ids into text one token at a time has two traps:

1. A token is not always whole characters. Byte-level BPE can split "🤖" (four UTF-8
   bytes) over several tokens; decoding the first alone gives "\\ufffd". So the text of
   new ids is held back while it ends with "\\ufffd", until a later id completes it.
2. A token's text can depend on its neighbours (SentencePiece drops the space of the
   first token it decodes). So ids are decoded inside a small window that starts a few
   tokens earlier, and only what the window adds beyond its already-read part counts:

       token_ids:  [ p p p p p | o o o | o ]        p = last prompt ids (context)
                     ^prefix_offset    ^read_offset      o = output ids
       new text = decode(ids[prefix_offset:])[len(decode(ids[prefix_offset:read_offset])):]

   When the new text is complete, both offsets move forward, so each step decodes a
   handful of ids whatever the output's length (this is vLLM's `detokenize_incrementally`).

`tokenizers.decoders.DecodeStream` implements the same window in Rust. It is not used
because it needs the raw `tokenizers` backend (not every transformers tokenizer has one),
and it cannot flush: bytes of a character the output never completes stay hidden, while
`tokenizer.decode` shows them as "\\ufffd". Here the algorithm is in plain sight and the
last update flushes, so the streamed text always ends equal to the decoded text.

Stop strings (vLLM's rule): text may only be streamed once no stop string can still
begin inside it, so the last `max(len(stop)) - 1` characters are held back until more
text (or the end of the request) arrives. When a stop string appears, even across a
token boundary, the text is cut before it (after it with include_stop_str_in_output),
`stop_reason` names it and the request is done. As in vLLM, stop strings are looked
for only once the output has more than `min_tokens` tokens, and a request the engine
stopped on a stop token (EOS, or one of stop_token_ids) leaves that token's text out
unless include_stop_str_in_output.

For byte-level tokenizers (every tokenizer tinyserve builds, Llama 3, Qwen) the final
`output_text` equals `tokenizer.decode(output_ids)`; for SentencePiece tokenizers it keeps
the leading space of the first output token, because the text continues the prompt.
"""

from collections.abc import Sequence

from transformers import PreTrainedTokenizerBase

from tinyserve.errors import InvalidInputError

# How many prompt ids the first window starts with: enough context for a tokenizer to
# decode the first output token as it reads mid-text (vLLM uses the same number).
INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET = 5


class IncrementalDetokenizer:
    """The text of one request's output, built as its token ids arrive."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_token_ids: Sequence[int],
        *,
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
        min_tokens: int = 0,
    ) -> None:
        if isinstance(stop, str) or not all(isinstance(s, str) and s for s in stop):
            raise InvalidInputError(f"stop must be a list of non-empty strings, got {stop!r}", "stop")
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = tuple(stop)
        self.include_stop_str_in_output = include_stop_str_in_output
        self.min_tokens = min_tokens
        self.num_output_tokens = 0
        # With the stop string kept in the output there is nothing to hide before it.
        self.stop_buffer_length = 0 if include_stop_str_in_output or not stop else max(map(len, stop)) - 1

        context = list(prompt_token_ids[-INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET:])
        if self._decode(context).endswith("\ufffd"):
            # The prompt ends inside a character (an ids prompt can): its bytes are the
            # prompt's, and must not complete a character in the output's text.
            context = []
        self.token_ids: list[int] = context
        self.prefix_offset = 0
        self.read_offset = len(context)

        self.output_text = ""
        self.stop_reason: str | None = None
        self.num_streamed_chars = 0

    def update(self, new_token_ids: Sequence[int], finished: bool = False, stop_terminated: bool = False) -> str:
        """Add the ids the engine produced and return the text that may be streamed now.

        Pass finished=True with the request's last ids (or alone): the held-back text is
        then returned too; stop_terminated=True when the engine stopped the request on
        its last id, a stop token whose text is not output. After a stop string was
        found, ids are ignored and "" returned.
        """
        if self.stop_reason is not None:
            return ""
        if stop_terminated and not self.include_stop_str_in_output:
            new_token_ids = new_token_ids[:-1]
        for token_id in new_token_ids:
            self.token_ids.append(token_id)
            self.num_output_tokens += 1
            self._append(self._decode_new_text(complete_characters_only=True))
            if self.stop_reason is not None:
                break
        if finished and self.stop_reason is None:
            # Bytes no later id will complete: decode them as tokenizer.decode does.
            self._append(self._decode_new_text(complete_characters_only=False))
        return self._take_streamable_text(everything=finished or self.stop_reason is not None)

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=self.skip_special_tokens)

    def _decode_new_text(self, complete_characters_only: bool) -> str:
        prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.token_ids[self.prefix_offset :])
        # Nothing new (a skipped special token), or an unfinished character: wait.
        if len(new_text) <= len(prefix_text) or (complete_characters_only and new_text.endswith("\ufffd")):
            return ""
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
        return new_text[len(prefix_text) :]

    def _append(self, text: str) -> None:
        if not text:
            return
        self.output_text += text
        if self.stop and self.num_output_tokens > self.min_tokens:
            self._cut_at_stop_string(num_new_chars=len(text))

    def _cut_at_stop_string(self, num_new_chars: int) -> None:
        """End the output at the earliest stop string that ends in the new text."""
        found: tuple[int, str] | None = None
        for stop_str in self.stop:
            # A match that ends in the new text starts at most len(stop_str) - 1 chars
            # before it; anything earlier was searched by previous calls.
            search_from = max(0, len(self.output_text) - num_new_chars - len(stop_str) + 1)
            index = self.output_text.find(stop_str, search_from)
            if index != -1 and (found is None or index < found[0]):
                found = (index, stop_str)
        if found is None:
            return
        index, stop_str = found
        self.stop_reason = stop_str
        self.output_text = self.output_text[: index + len(stop_str) if self.include_stop_str_in_output else index]

    def _take_streamable_text(self, everything: bool) -> str:
        end = len(self.output_text) if everything else len(self.output_text) - self.stop_buffer_length
        if end <= self.num_streamed_chars:
            return ""
        delta = self.output_text[self.num_streamed_chars : end]
        self.num_streamed_chars = end
        return delta
