"""The OpenAI protocol layer without a server: request bodies, sampling defaults, the chat template's messages."""

from types import SimpleNamespace

from tinyserve.entrypoints.api.openai_protocol import ChatCompletionRequest
from tinyserve.entrypoints.api.serving_engine import ServingContext


def test_server_defaults_come_from_the_generation_config_where_it_sets_them():
    model_info = SimpleNamespace(max_model_len=100,
                                 generation_defaults={"temperature": 0.0, "top_k": 5, "max_tokens": 3})
    ctx = ServingContext(engine=SimpleNamespace(model_info=model_info), model_names=["tiny"])
    body = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], top_p=0.5)
    params = body.sampling_params(ctx.max_tokens_for(10, None), None, ctx.sampling_defaults)
    assert (params.temperature, params.top_k, params.top_p, params.min_p, params.max_tokens) == (0.0, 5, 0.5, 0.0, 3)
    assert ctx.max_tokens_for(10, 50) == 3  # max_new_tokens caps a request's max_tokens too (vLLM's rule)
    plain_info = SimpleNamespace(max_model_len=100, generation_defaults={})
    plain = ServingContext(engine=SimpleNamespace(model_info=plain_info), model_names=["tiny"])
    assert plain.sampling_defaults == {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0,
                                       "repetition_penalty": 1.0}
    assert plain.max_tokens_for(10, None) == 90


def test_a_chat_messages_name_reaches_the_template():
    body = ChatCompletionRequest(messages=[{"role": "user", "content": "hi", "name": "Tim"},
                                           {"role": "user", "content": "hello"}])
    assert [m.as_template_message() for m in body.messages] == [
        {"role": "user", "content": "hi", "name": "Tim"}, {"role": "user", "content": "hello"}]
