"""A request's prompt blocks, hashed as the backends' engines hash them (for prefix-aware routing).

The prompt's tokens come from tinyserve's own Renderer over the backends' model: the chat
template and the tokenizer, as the server applies them (stage ②); a completion's prompt is
tokenized as the server does, with special tokens unless the request says otherwise. Each
full block of `block_size` tokens is then hashed as engine/core/block_pool.py's BlockHash
chains them (SHA-256 of the parent's digest and the block's token ids, the first from b""),
and shortened to the 64-bit int the KV events carry (kv_events/events.py). Only full blocks
are ever cached, so only they are hashed.
"""

import json

from tinyserve.engine.core.block_pool import BlockHash
from tinyserve.kv_events.events import external_block_hash

_MAX_PROMPT_CHARS = 1 << 20  # a bigger prompt or chat is not hashed (the backend will refuse it anyway)


def _has_images(message) -> bool:
    content = message.get("content") if isinstance(message, dict) else None
    return isinstance(content, list) and any(isinstance(p, dict) and p.get("type") != "text" for p in content)


class PromptHasher:
    def __init__(self, model: str, block_size: int | None) -> None:
        """model: the backends' model folder or name, for its tokenizer and chat template.
        block_size: the backends' KV block size (None: set later, from what the backends report)."""
        from tinyserve.config import EngineArgs, ModelInfo
        from tinyserve.frontend.render import Renderer
        from tinyserve.models.tokenizer import load_tokenizer

        info = ModelInfo.from_args(EngineArgs(model=model))
        self.renderer = Renderer(info, load_tokenizer(info.path))
        self.block_size = block_size

    def token_ids(self, path: str, body: dict) -> list[int] | None:
        """The prompt's token ids as the backend will see them; None when there is no single prompt to read."""
        try:
            if path.endswith("/chat/completions"):
                if len(json.dumps([body["messages"], body.get("tools")])) > _MAX_PROMPT_CHARS:
                    return None  # rendering and tokenizing it would hold many times its size
                if any(_has_images(message) for message in body["messages"]):
                    return None  # the router reads no image (and a backend keys its blocks by theirs too)
                return self.renderer.tokenize_chat(
                    body["messages"], fit_context=False, add_generation_prompt=body.get("add_generation_prompt", True),
                    continue_final_message=body.get("continue_final_message", False),
                    template_kwargs=body.get("chat_template_kwargs"), tools=body.get("tools")).prompt_token_ids
            prompt = body.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1 and not isinstance(prompt[0], int):
                prompt = prompt[0]  # one prompt in a list
            if isinstance(prompt, str) and len(prompt) > _MAX_PROMPT_CHARS:
                return None
            return self.renderer.tokenize_prompt(
                prompt, add_special_tokens=body.get("add_special_tokens", True)).prompt_token_ids
        except (KeyError, TypeError, ValueError):
            return None  # a request the backend will refuse, or several prompts: nothing to route on

    def block_hashes(self, token_ids: list[int]) -> list[int]:
        """The 64-bit hash of each full block of `token_ids`, in order."""
        hashes, parent, size = [], b"", self.block_size
        for start in range(0, len(token_ids) - size + 1, size):
            parent = BlockHash(parent, tuple(token_ids[start:start + size])).value
            hashes.append(external_block_hash(parent))
        return hashes
