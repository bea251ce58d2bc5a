"""Stage ② off the event loop: chat templates, tokenizing and large detokenizing run in threads.

The API process serves every connection from one event loop. A chat template is
Python (Jinja) and tokenizing a 4 MB prompt takes seconds; run on the loop,
either would hold up every other request's stream, first byte and /health for
that long. So they run here, in threads, as vLLM's API server runs its
tokenizer in a thread pool, and the loop awaits the result:

    event loop ──► small lane (1 thread)   jobs up to LARGE_JOB_CHARS characters   ──► result back
               └─► large lane (1 thread)   anything larger: a big prompt, a chat of
                                           thousands of messages, /detokenize of many ids

Two lanes, so that a large job makes only other large jobs wait: an ordinary
request is never queued behind a 4 MB one. The loop keeps running meanwhile
because the Rust tokenizer lets go of the GIL while it works (when called as
InputProcessor.encode and decode call it) and Python code (Jinja) is made to
hand it back every few milliseconds (sys.getswitchinterval).
What a thread cannot hand back is a single C call that holds the GIL: turning
millions of ids into a Python list, or JSON-encoding them in one go. Those are
kept to what cannot be avoided (InputProcessor.encode) or cut into slices (the
/tokenize answer, serving_tokenization.py).

A request's structured-output constraint is checked in a third lane (two threads), within the
grammar deadline (--structured-outputs-compile-timeout) counted from the request's arrival.

Before a job is queued, the cheap size checks of the input processor refuse
what could never fit the context, so a hopeless request does not wait for a lane.
"""

import asyncio
import functools
import time
from concurrent.futures import ThreadPoolExecutor

from tinyserve.frontend.input_processor import InputProcessor, ProcessedPrompt
from tinyserve.structured_output import compile_deadline_error

# A job above this many characters takes the large lane. Tokenizing this much takes
# tens of milliseconds, so no small job holds its lane long.
LARGE_JOB_CHARS = 64 * 1024
LARGE_JOB_MESSAGES = 1024  # a chat with more messages than this takes the large lane whatever its length
CHARS_PER_ID = 4  # what one token id weighs when choosing a lane: about the characters of its text


class RenderThreads:
    """The input processor's chat and prompt tokenizing and its decode, awaited on the loop, run in two lanes."""

    def __init__(self, input_processor: InputProcessor) -> None:
        self.input_processor = input_processor
        self.small = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tinyserve-render")
        self.large = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tinyserve-render-large")
        self.constraints = ThreadPoolExecutor(max_workers=2, thread_name_prefix="tinyserve-constraints")

    async def run(self, size: int, function, /, *args, **kwargs):
        """`function(*args, **kwargs)` in the lane for a job of `size` characters."""
        lane = self.large if size > LARGE_JOB_CHARS else self.small
        return await asyncio.get_running_loop().run_in_executor(lane, functools.partial(function, *args, **kwargs))

    async def tokenize_chat(self, messages: list[dict], *, fit_context: bool = True, **kwargs) -> ProcessedPrompt:
        """InputProcessor.tokenize_chat; with fit_context, more messages than max_model_len are refused before
        the chat queues."""
        if fit_context:
            self.input_processor.check_chat_fits(messages)
        if isinstance(messages, list) and len(messages) > LARGE_JOB_MESSAGES:
            size = LARGE_JOB_CHARS + 1
        else:
            size = sum(len(m.get("content") or "") for m in messages if isinstance(m, dict)) \
                if isinstance(messages, list) else 0
        return await self.run(size, self.input_processor.tokenize_chat, messages, fit_context=fit_context, **kwargs)

    async def tokenize_prompt(self, prompt, *, add_special_tokens: bool = True, truncation=None) -> ProcessedPrompt:
        """InputProcessor.tokenize_prompt; a text that cannot fit max_model_len is refused before it queues
        (unless it is to be truncated: render.Truncation). {"prompt_embeds": base64} is read in a lane too."""
        if isinstance(prompt, str):
            if prompt and truncation is None:
                self.input_processor.check_text_fits(prompt)
            return await self.run(len(prompt), self.input_processor.tokenize_prompt, prompt,
                                  add_special_tokens=add_special_tokens, truncation=truncation)
        if isinstance(prompt, dict) and isinstance(prompt.get("prompt_embeds"), str):
            # base64 decoded and torch.load read in a lane: megabytes of it would hold up the loop
            self.input_processor.check_embeds_enabled()
            return await self.run(len(prompt["prompt_embeds"]), self.input_processor.embeds_prompt,
                                  prompt["prompt_embeds"], truncation)
        return self.input_processor.tokenize_prompt(prompt, add_special_tokens=add_special_tokens,
                                                    truncation=truncation)

    async def check_constraint(self, params, arrival_time: float, engine_args) -> None:
        """InputProcessor.check_structured_outputs, in a lane of its own, within the grammar deadline counted from
        `arrival_time`: parsing a schema of thousands of properties takes seconds, and the deadline bounds the
        client's whole wait. A check past it runs on (it cannot be stopped); one not started is dropped."""
        constraint = getattr(params, "structured_outputs", None)
        if constraint is None:
            return
        compile_timeout = engine_args.structured_outputs_compile_timeout
        check = self.constraints.submit(self.input_processor.check_structured_outputs, constraint)
        left = compile_timeout - (time.time() - arrival_time) if compile_timeout else None
        try:
            await asyncio.wait_for(asyncio.wrap_future(check), left)
        except asyncio.TimeoutError:
            raise compile_deadline_error(compile_timeout) from None

    async def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """InputProcessor.encode: any length (/tokenize counts what it is given)."""
        return await self.run(len(text), self.input_processor.encode, text, add_special_tokens=add_special_tokens)

    async def decode(self, token_ids: list[int]) -> str:
        return await self.run(len(token_ids) * CHARS_PER_ID, self.input_processor.decode, token_ids)

    def shutdown(self) -> None:
        """Stop both lanes; jobs queued and not started are dropped. Safe to call twice."""
        for lane in (self.small, self.large, self.constraints):
            lane.shutdown(wait=False, cancel_futures=True)

