"""A streamed chat's chunks, against a stream of RequestOutputs the test hands over one at a time."""

import asyncio
import json

from tinyserve.entrypoints.api.serving_chat import ChatAnswer, chat_stream
from tinyserve.outputs import CompletionOutput, RequestOutput


def answer(n: int = 1) -> ChatAnswer:
    return ChatAnswer(request_id="chatcmpl-1", created=0, model="m", num_prompt_tokens=3, n=n, num_top=0,
                      tokens_as_ids=False, make_calls=None)


def output(text: str, token_ids: list[int], finish_reason: str | None = None) -> RequestOutput:
    return RequestOutput("r", None, [1, 2, 3], [CompletionOutput(0, text, token_ids, finish_reason)],
                         finished=finish_reason is not None)


def choices(chunk: str) -> list[dict]:
    return json.loads(chunk.removeprefix("data: "))["choices"]


async def read(outputs: list[RequestOutput], pulled: list[int], n: int = 1) -> list[tuple[int, str]]:
    """Every chunk, with how many outputs the stream had handed over when it was yielded."""
    async def stream():
        for item in outputs:
            pulled.append(1)
            yield item

    return [(len(pulled), chunk) async for chunk in chat_stream(answer(n), stream(), include_usage=False)]


def test_the_role_chunk_comes_with_the_first_output_as_in_vllm():
    """A client's first chunk (where vLLM's benchmark stops its time-to-first-token clock) is the first token's."""
    pulled: list[int] = []
    chunks = asyncio.run(read([output("a", [5]), output("b", [6], "length")], pulled, n=2))
    assert [(seen, choices(chunk)[0]["delta"]) for seen, chunk in chunks[:2]] == [
        (1, {"role": "assistant", "content": ""}), (1, {"role": "assistant", "content": ""})]
    assert [choices(chunk)[0]["index"] for _, chunk in chunks[:2]] == [0, 1]


def test_a_token_whose_text_is_held_back_gets_an_empty_content_chunk():
    pulled: list[int] = []
    chunks = asyncio.run(read([output("", [5]), output("", [6]), output("xy", [7], "length")], pulled))
    deltas = [choices(chunk)[0]["delta"] for _, chunk in chunks[1:]]
    assert deltas == [{"content": ""}, {"content": ""}, {"content": "xy"}]
    assert [choices(chunk)[0]["finish_reason"] for _, chunk in chunks[1:]] == [None, None, "length"]


def test_an_output_with_no_new_token_and_no_text_sends_nothing():
    pulled: list[int] = []
    chunks = asyncio.run(read([output("a", [5]), output("", []), output("b", [6], "stop")], pulled))
    assert [choices(chunk)[0]["delta"] for _, chunk in chunks[1:]] == [{"content": "a"}, {"content": "b"}]
