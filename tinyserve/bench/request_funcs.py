"""One benchmark request: stream it from an OpenAI-compatible endpoint and time its chunks.

The timestamps are the ones vLLM's serving benchmark records (time.perf_counter, seconds):

    sent ───────► first token chunk ──► chunk ──► chunk ── … ──► last chunk
    │◄── TTFT ───►│◄──── ITL[0] ────►│◄ ITL[1] ►│
    │◄─────────────────────── latency (E2EL) ──────────────────►│

A token chunk is a server-sent event `data: {...}` with a choice, as vLLM's benchmark counts
them: its text may be empty (a token whose text the server holds back, half a character or
a possible stop string, still gets its chunk from vLLM's server and ours). A chat stream
opens with a bare {"role": "assistant"} delta, sent with the first token; it is not a token
itself, and the first token's own chunk follows it at once. The last event before `data: [DONE]` holds the
server's "usage" (requested with stream_options.include_usage): the token counts come
from there, not from re-tokenizing the text. A server that sends no usage gets its
output counted as one token per token chunk, which undercounts when a chunk holds
several tokens.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported where used: `tinyserve bench --help` reads ENDPOINTS without it
    import httpx

COMPLETIONS = "/v1/completions"
CHAT_COMPLETIONS = "/v1/chat/completions"
ENDPOINTS = (COMPLETIONS, CHAT_COMPLETIONS)


@dataclass(slots=True)
class RequestFuncInput:
    endpoint: str  # COMPLETIONS or CHAT_COMPLETIONS
    model: str
    prompt: list[int] | str  # token ids (completions) or text (either endpoint)
    prompt_len: int
    output_len: int
    temperature: float = 0.0
    ignore_eos: bool = False

    def payload(self) -> dict:
        common = {"model": self.model, "temperature": self.temperature, "stream": True,
                  "stream_options": {"include_usage": True}}
        if self.ignore_eos:
            common["ignore_eos"] = True
        if self.endpoint == COMPLETIONS:
            return {**common, "prompt": self.prompt, "max_tokens": self.output_len}
        return {**common, "messages": [{"role": "user", "content": self.prompt}],
                "max_completion_tokens": self.output_len}


@dataclass(slots=True)
class RequestFuncOutput:
    success: bool = False
    generated_text: str = ""
    prompt_len: int = 0  # the server's usage.prompt_tokens when it sent usage (a chat template adds tokens)
    output_tokens: int = 0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    error: str = ""

    @property
    def tpot(self) -> float:
        """Time per output token after the first; 0 for a one-token output (vLLM's convention for goodput)."""
        return (self.latency - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else 0.0


def _choice_text(endpoint: str, choice: dict) -> str:
    if endpoint == COMPLETIONS:
        return choice.get("text") or ""
    return (choice.get("delta") or {}).get("content") or ""


def _sse_data(line: str) -> str | None:
    """The payload of a `data:` line; None for blank lines, comments and other fields."""
    if not line.startswith("data:"):
        return None
    return line[len("data:"):].strip()


async def send_request(client: httpx.AsyncClient, base_url: str, request: RequestFuncInput) -> RequestFuncOutput:
    """Send one streamed request; never raises for a failed request (success=False, error set)."""
    import httpx

    output = RequestFuncOutput(prompt_len=request.prompt_len)
    num_token_chunks = 0
    usage = None
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", base_url + request.endpoint, json=request.payload()) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode("utf-8", errors="replace")
                output.error = f"HTTP {response.status_code}: {body[:500]}"
                return output
            async for line in response.aiter_lines():
                data = _sse_data(line)
                if not data:
                    continue
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    output.error = str(chunk["error"].get("message", chunk["error"]))
                    return output
                if chunk.get("usage"):
                    usage = chunk["usage"]
                choices = chunk.get("choices")
                if not choices:
                    continue
                if "role" in (choices[0].get("delta") or {}):
                    continue  # the chat stream's opening role delta: no token of its own
                text = _choice_text(request.endpoint, choices[0])
                now = time.perf_counter()
                if num_token_chunks == 0:
                    output.ttft = now - start
                else:
                    output.itl.append(now - last)
                last = now
                num_token_chunks += 1
                output.generated_text += text
    except (httpx.HTTPError, json.JSONDecodeError) as error:
        output.error = f"{type(error).__name__}: {error}"
        return output
    if num_token_chunks == 0:
        output.error = "the stream ended without a token chunk"
        return output
    output.latency = last - start
    output.output_tokens = usage["completion_tokens"] if usage else num_token_chunks
    if usage:
        output.prompt_len = usage["prompt_tokens"]
    output.success = True
    return output
