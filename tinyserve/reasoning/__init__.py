"""Reasoning parsers (`--reasoning-parser`, vLLM's names): a model's answer read as its reasoning and its content.

Runs in the API process, after the detokenizer (stage ⑨): the engine generates the whole text as
it always does, and the chat, Responses and Anthropic messages handlers hand each choice's new text
to a reader (completions, as vLLM's, read none: only where a constraint starts).

    parsers.py    ThinkingReader: one choice's text split at <think> and </think>, streamed or whole;
                  the deepseek_r1 and qwen3 rules, and the tokens counted as reasoning
    layer.py      the layer: built from the flag and the tokenizer; reasoning_effort into the
                  chat template; the readers of a request's choices; where a constraint starts
                  (after </think>: the engine is handed the end's token id); the tinyserve.reasoning span

The rest of tinyserve meets it at one seam, the answer layers (entrypoints/api/answer_layers.py),
listed in tinyserve/assemble.py's ANSWER_LAYERS. See docs/design.md, "Adding a layer".
"""
