"""What the API's handlers share: the serving context, usage, rendering a chat, tool-call plans.

vLLM keeps the same in serving_engine.py (OpenAIServing). Each handler (serving_chat.py's,
serving_completion.py's, anthropic_serving.py's, responses_serving.py's) validates the
body, asks the front end for room (a 503 when the waiting queue is full), renders and
tokenizes the prompt (`render_and_tokenize`), turns the body into SamplingParams, sends the
request, and only then answers: it streams SSE chunks as RequestOutput deltas arrive, or
waits for the final output and answers with one JSON body. Every request stream is closed
however the response ends (sse.py).
"""

import functools
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import NamedTuple

from tinyserve.entrypoints.api.answer_layers import AnswerLayers
from tinyserve.entrypoints.api.errors import APIError, openai_error_body
from tinyserve.entrypoints.api.sse import sse_data, stream_error_status
from tinyserve.entrypoints.api.tools.tool_calls import ToolCallDeltas, tool_constraint, tools_for_constraint
from tinyserve.entrypoints.api.truncation import fitted_max_tokens
from tinyserve.errors import InvalidInputError
from tinyserve.frontend.async_llm import AsyncLLM
from tinyserve.frontend.input_processor import ProcessedPrompt
from tinyserve.frontend.render import Truncation
from tinyserve.lifecycle import schema
from tinyserve.lora.registry import LoRARegistry
from tinyserve.lora_request import LoRARequest
from tinyserve.outputs import RequestOutput
from tinyserve.sampling_params import SamplingParams


@dataclass(slots=True)
class ServingContext:
    engine: AsyncLLM
    model_names: list[str]  # the first is the one reported in responses
    redact_inputs: bool = False  # traces keep token counts but no text or token ids
    tool_call_parser: str | None = None  # how "auto" tool calls are read (--enable-auto-tool-choice); None: refused
    return_tokens_as_token_ids: bool = False  # --return-tokens-as-token-ids: logprob tokens as "token_id:N"
    loras: LoRARegistry | None = None  # --enable-lora: the adapters a request's model may name (tinyserve/lora/)
    per_request_metrics: bool = False  # --enable-per-request-metrics: answers carry vLLM's `metrics` object
    # What reads an answer before it is sent (a reasoning parser: answer_layers.py); none: the text is the content
    answer_layers: AnswerLayers = field(default_factory=AnswerLayers)

    def check_model(self, model: str | None) -> str:
        """The served name a response reports; a model left out or empty ("") is the served one, as in vLLM.
        A LoRA adapter's name is reported as itself."""
        if model and self.lora_request(model) is not None:
            return model
        if model and model not in self.model_names:
            available = self.model_names + (list(self.loras.adapters) if self.loras else [])
            raise APIError(404, f"The model `{model}` does not exist. Available: {available}", "model")
        return self.model_names[0]

    def lora_request(self, model: str | None) -> LoRARequest | None:
        """The LoRA adapter a request's model names, or None (the base model)."""
        return self.loras.get(model) if self.loras is not None and model else None

    @property
    def model_root(self) -> str:
        """Where the served model came from, as /v1/models gives it in each card's `root`."""
        return str(self.engine.model_info.path)

    def check_tokenizer_model(self, model: str | None) -> None:
        """check_model for /tokenize and /detokenize, which take the `root` of /v1/models too: clients that
        tokenize remotely (lm-eval's) name the tokenizer by the model it came from."""
        if model != self.model_root:
            self.check_model(model)

    def tokens_as_ids(self, requested: bool | None) -> bool:
        """A request's return_tokens_as_token_ids; left out (None), the server's flag decides."""
        return self.return_tokens_as_token_ids if requested is None else requested

    @property
    def sampling_defaults(self) -> dict:
        """What a request that leaves a sampling parameter out gets: the model's generation_config.json
        where it sets one (vLLM's generation_config="auto"), else the OpenAI API's default."""
        defaults = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}
        model = self.engine.model_info.generation_defaults
        return defaults | {name: model[name] for name in defaults if name in model}

    def sampling_params(self, max_tokens: int, **given) -> SamplingParams:
        """SamplingParams of the request's values (temperature=, top_p=, top_k=, stop=, structured_outputs=),
        each one it left out (None) taken from sampling_defaults: the Responses and Messages APIs' rule."""
        chosen = {name: value for name, value in given.items() if value is not None}
        return SamplingParams(max_tokens=max_tokens, **(self.sampling_defaults | chosen))

    def max_tokens_for(self, num_prompt_tokens: int, requested: int | None) -> int:
        """vLLM's rule: default to the rest of the context, capped by the model's max_new_tokens
        when its generation_config.json sets one; refuse what cannot fit."""
        max_model_len = self.engine.model_info.max_model_len
        if num_prompt_tokens > max_model_len:
            raise APIError(400, f"prompt has {num_prompt_tokens} tokens, more than max_model_len={max_model_len}",
                           "prompt")
        if num_prompt_tokens >= max_model_len and requested is None:
            raise APIError(400, f"prompt has {num_prompt_tokens} tokens, but max_model_len is {max_model_len}", "messages")
        cap = self.engine.model_info.generation_defaults.get("max_tokens")
        if requested is None:
            return min(max_model_len - num_prompt_tokens, cap or max_model_len)
        if num_prompt_tokens + requested > max_model_len:
            excess = num_prompt_tokens + requested - max_model_len
            raise APIError(
                400,
                f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                f"{num_prompt_tokens + requested} tokens ({num_prompt_tokens} in the prompt, {requested} for the "
                f"completion), {excess} too many. Reduce the prompt or max_tokens.",
                "max_tokens",
            )
        return min(requested, cap or requested)


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0, details: dict | None = None) -> dict:
    """OpenAI's usage; cached_tokens: prompt tokens whose KV came from the prefix cache; details: the answer
    layers' completion_tokens_details (reasoning_tokens, with a reasoning parser), left out when there are none."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens},
            **({"completion_tokens_details": details} if details else {})}


def running_usage(prompt_tokens: int, completion_tokens: int) -> dict:
    """The usage each chunk of a stream carries with vLLM's continuous_usage_stats: the counts so far."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


LOGPROB_FLOOR = -9999.0  # vLLM's: JSON has no -inf


def json_logprob(logprob: float) -> float:
    """A logprob as JSON can carry it: a token that cannot be sampled (one a grammar masks out, say)
    has a logprob of -inf, which is answered as -9999.0, as vLLM answers it."""
    return max(logprob, LOGPROB_FLOOR)


def logprob_token(token_id: int, decoded: str | None, as_token_id: bool) -> str | None:
    """A logprob entry's token: its text, or with return_tokens_as_token_ids "token_id:N" (vLLM's form,
    for clients that need the exact token whatever its text is: byte fragments, tokens of equal text)."""
    return f"token_id:{token_id}" if as_token_id else decoded


def prompt_logprobs_json(output: RequestOutput) -> list | None:
    """vLLM's prompt_logprobs: per prompt token, None for the first (nothing predicts it), then
    {token id: {logprob, rank, decoded_token}} for the prompt's own token and the most likely ones."""
    if output.prompt_logprobs is None:
        return None
    return [None if position is None else {
        str(token_id): {"logprob": json_logprob(lp.logprob), "rank": lp.rank, "decoded_token": lp.decoded_token}
        for token_id, lp in position.items()
    } for position in output.prompt_logprobs]


async def tokenize(ctx: ServingContext, prompt, *, add_special_tokens: bool = True,
                   truncation=None) -> ProcessedPrompt:
    """Tokenize in a thread (frontend/render_threads.py): a long prompt must not stall the event loop.
    truncation: a render.Truncation (a request's truncate_prompt_tokens, truncation.py)."""
    try:
        processed = await ctx.engine.render_threads.tokenize_prompt(prompt, add_special_tokens=add_special_tokens,
                                                                    truncation=truncation)
    except ValueError as error:  # an InvalidInputError names its field (prompt_embeds, truncate_prompt_tokens)
        raise APIError(400, str(error), getattr(error, "param", None) or "prompt") from error
    return processed


async def guard_stream(events: AsyncIterator[str]) -> AsyncIterator[str]:
    """End a stream with an error event, never a hang or a cut, when something fails mid-stream."""
    try:
        async for event in events:
            yield event
    except Exception as error:
        status, message = stream_error_status(error)
        yield sse_data(openai_error_body(status, message))
    yield sse_data("[DONE]")


class ToolCallPlan(NamedTuple):
    """What a request's tool_choice and response_format make of its output."""

    constraint: object  # the output's structured_outputs constraint, or None
    field: str | None  # the request field it came from (a grammar error names it)
    make_calls: Callable[[], ToolCallDeltas] | None  # a reader of tool calls out of the text, one per choice


def tool_call_plan(ctx: ServingContext, constraint, field: str | None, choice, tools,
                   parallel_tool_calls: bool) -> ToolCallPlan:
    """What a tool_choice makes of a request (chat's and the Responses API's alike).

    constraint, field: the request's own (response_format, say); choice: None (no tools), "none",
    "auto", "required" or {"name": ...}; tools: structured_protocol.Tool models. A "required" or
    named tool_choice is a constraint of its own; "auto" reads the calls out of free text with the
    server's tool-call parser.
    """
    if choice in (None, "none"):
        return ToolCallPlan(constraint, field, None)
    if choice == "auto":
        if ctx.tool_call_parser is None:
            raise APIError(400, '"auto" tool choice needs the server started with --enable-auto-tool-choice and '
                           '--tool-call-parser; or give tool_choice "required", "none" or a function', "tool_choice")
        return ToolCallPlan(constraint, field, functools.partial(ToolCallDeltas, ctx.tool_call_parser,
                                                                 parallel_tool_calls=parallel_tool_calls))
    tools = tools_for_constraint(tools)
    if choice == "required":
        return ToolCallPlan(tool_constraint(tools, choice, parallel_tool_calls), "tools",
                            functools.partial(ToolCallDeltas, "required"))
    return ToolCallPlan(tool_constraint(tools, choice), "tool_choice",
                        functools.partial(ToolCallDeltas, "named", choice["name"]))


async def add_constrained_request(engine: AsyncLLM, constrained_field: str | None, prompt, params, request_id: str,
                                  **kwargs):
    """engine.add_request; a constraint the grammar library refuses is a 400 naming the field it came from."""
    engine.observers.get(request_id).log_lora(kwargs.get("lora_request"))  # the adapter (if any), logged for replay
    try:
        stream = await engine.add_request(prompt, params, request_id, **kwargs)
        stream.constraint_field = constrained_field
        return stream
    except InvalidInputError as error:
        if error.param == "structured_outputs" and constrained_field is not None:
            raise APIError(400, str(error), constrained_field) from error
        if error.param == "lora_request":  # over HTTP, the adapter is named by the request's model
            raise APIError(400, str(error), "model") from error
        raise


async def render_and_tokenize(ctx: ServingContext, request_id: str, messages: list[dict], add_generation_prompt: bool,
                              requested_max_tokens: int | None, make_params, continue_final_message: bool = False,
                              template_kwargs: dict | None = None, tools: list[dict] | None = None,
                              truncation: Truncation | None = None):
    """Stage ②: template, tokenize (both in a thread), check lengths, build SamplingParams — logged on the
    render span of the request's spans (found by its id: registered with engine.observers). truncation (a
    chat's truncate_prompt_tokens, truncation.py): the rendered prompt's ids cut to it, as a completion's
    are, and max_tokens fitted to what is left; the span then logs the ids kept, and no prompt text."""
    spans = ctx.engine.observers.get(request_id)
    with spans.stage(schema.RENDER) as render_span:
        try:
            prompt = await ctx.engine.render_threads.tokenize_chat(
                messages, fit_context=truncation is None, add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, template_kwargs=template_kwargs, tools=tools)
        except ValueError as error:  # the prompt's length (param "prompt"), or the messages themselves
            raise APIError(400, str(error), getattr(error, "param", None) or "messages") from error
        if truncation is not None:
            prompt = truncation.apply_to(prompt)
            requested_max_tokens = fitted_max_tokens(requested_max_tokens, len(prompt.prompt_token_ids),
                                                     ctx.engine.model_info.max_model_len)
        text = prompt.prompt
        max_tokens = ctx.max_tokens_for(len(prompt.prompt_token_ids), requested_max_tokens)
        try:
            params = ctx.engine.input_processor.seeded(make_params(max_tokens))  # traced: a seed, to replay
        except ValueError as error:
            raise APIError(400, str(error)) from error
        spans.log_inputs(render_span, prompt=text, prompt_token_ids=prompt.prompt_token_ids, sampling_params=params,
                         messages=messages, mm_features=prompt.mm_features)
    return prompt, params
