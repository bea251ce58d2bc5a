"""POST /tokenize and /detokenize: the model's tokenizer, as vLLM's server offers it.

/tokenize counts a prompt or a rendered chat of any length (its answer says
max_model_len, for the client to compare), so it is where a 4 MB text really is
tokenized. Everything that grows with the payload runs in the render threads
(frontend/render_threads.py), the answer's JSON included: a list of millions of
ids, encoded in one call on the event loop, would stall every other request.
"""

import json

from fastapi.responses import Response

from tinyserve.frontend.render_threads import CHARS_PER_ID
from tinyserve.entrypoints.api.errors import APIError
from tinyserve.entrypoints.api.openai_protocol import DetokenizeRequest, TokenizeRequest
from tinyserve.entrypoints.api.serving_engine import ServingContext

_JSON_SLICE = 65536  # ids JSON-encoded per call, so that no one call holds the GIL for long


def tokens_body(token_ids: list[int], max_model_len: int, tokenizer=None) -> bytes:
    """The /tokenize answer, built slice by slice: between slices the thread lets the event loop run.

    With a tokenizer (return_token_strs), token_strs is each token as vLLM gives it,
    `tokenizer.convert_ids_to_tokens`: the vocabulary's spelling ("Ġis" for " is" in a
    byte-level BPE), not decoded text; null when not asked.
    """
    parts = ['{"tokens":[']
    for start in range(0, len(token_ids), _JSON_SLICE):
        parts.append(("," if start else "") + ",".join(map(str, token_ids[start:start + _JSON_SLICE])))
    parts.append(f'],"count":{len(token_ids)},"max_model_len":{max_model_len},"token_strs":')
    if tokenizer is None:
        parts.append("null")
    else:
        parts.append("[")
        for start in range(0, len(token_ids), _JSON_SLICE):
            strs = tokenizer.convert_ids_to_tokens(token_ids[start:start + _JSON_SLICE])
            parts.append(("," if start else "") + json.dumps(strs, ensure_ascii=False, separators=(",", ":"))[1:-1])
        parts.append("]")
    parts.append("}")
    return "".join(parts).encode()


async def tokenize(ctx: ServingContext, body: TokenizeRequest) -> Response:
    ctx.check_tokenizer_model(body.model)
    engine = ctx.engine
    threads = engine.render_threads
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "send exactly one of 'prompt' or 'messages'")
    if body.messages is not None:
        try:  # the ids a chat request would send, control tokens typed in messages encoded as text
            prompt = await threads.tokenize_chat(
                [m.as_template_message() for m in body.messages], fit_context=False,
                add_generation_prompt=body.add_generation_prompt, continue_final_message=body.continue_final_message,
            )
        except ValueError as error:
            raise APIError(400, str(error), "messages") from error
        token_ids = prompt.prompt_token_ids
    else:
        token_ids = await threads.encode(body.prompt, add_special_tokens=body.add_special_tokens)
    content = await threads.run(len(token_ids) * CHARS_PER_ID, tokens_body, token_ids, engine.model_info.max_model_len,
                                engine.tokenizer if body.return_token_strs else None)
    return Response(content, media_type="application/json")


async def detokenize(ctx: ServingContext, body: DetokenizeRequest) -> Response:
    ctx.check_tokenizer_model(body.model)
    vocab_size = ctx.engine.model_info.vocab_size
    threads = ctx.engine.render_threads
    bad = await threads.run(len(body.tokens) * CHARS_PER_ID,
                            lambda: [t for t in body.tokens if not 0 <= t < vocab_size][:5])
    if bad:
        raise APIError(400, f"tokens contains ids outside the vocabulary [0, {vocab_size}): {bad}", "tokens")
    text = await threads.decode(body.tokens)
    content = await threads.run(len(text), json.dumps, {"prompt": text}, ensure_ascii=False, separators=(",", ":"))
    return Response(content.encode(), media_type="application/json")


def tokenizer_info(ctx: ServingContext) -> dict:
    """GET /tokenizer_info, as vLLM's: the tokenizer's configuration (its init arguments, made JSON), its
    class and the chat template. lm-eval's local-completions reads eos_token here, then tokenizes remotely."""
    tokenizer = ctx.engine.tokenizer
    config = {key: value for key, value in (getattr(tokenizer, "init_kwargs", None) or {}).items()
              if key not in ("tokenizer_object", "added_tokens_decoder", "name_or_path") and not key.endswith("_file")}
    info = json.loads(json.dumps(config, default=str))  # AddedToken and the like, as their text
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        info[name] = getattr(tokenizer, name, None)
    info["tokenizer_class"] = type(tokenizer).__name__
    if tokenizer.chat_template is not None:
        info["chat_template"] = tokenizer.chat_template
    return info
