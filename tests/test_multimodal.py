"""Images (tinyserve/multimodal/): a LLaVA checkpoint's prompts with images give transformers' greedy tokens.

On tests/llava_checkpoints.py's tiny LLaVA (random weights, transformers' own classes and processor):
the image encoder's rows equal transformers' image features; offline `LLM.generate` with
`multi_modal_data` gives transformers' tokens for one image, two in one prompt, images of different
sizes, several image requests batched beside text-only ones, chunked through the placeholders,
preempted, and with the prefix cache on, where the same image is a hit (in the prefix cache and the
encoder cache) and the same text with another image is not; the step and queue spans say which images
ran and whether the encoder cache had them. Bad input is an InvalidInputError naming multi_modal_data.
"""

import pytest
import torch

from tests.llava_checkpoints import (ROWS_PER_IMAGE, hf_chat_greedy, hf_greedy_with_images, hf_llava, image,
                                     llava_checkpoint)
from tests.tiny_checkpoints import tiny_model_with_tokenizer
from tinyserve import LLM, SamplingParams
from tinyserve.errors import InvalidInputError

MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
PROMPTS = [  # (text, images)
    ("USER: <image> what is this? ASSISTANT:", [image(0)]),
    ("compare <image> with <image> please", [image(1, 64, 32), image(0)]),  # two, of other sizes
    ("USER: <image> what is this? ASSISTANT:", [image(2, 100, 100)]),  # the same text, another image
]
TEXT_ONLY = [5, 17, 42, 8, 99]


def as_prompt(text: str, images: list) -> dict:
    return {"prompt": text, "multi_modal_data": {"image": images if len(images) != 1 else images[0]}}


def expected(prompts=PROMPTS) -> list[list[int]]:
    return [hf_greedy_with_images(llava_checkpoint(), text, images, MAX_TOKENS) for text, images in prompts]


def token_ids(outputs) -> list[list[int]]:
    return [list(output.outputs[0].token_ids) for output in outputs]


def test_the_image_encoder_gives_transformers_image_features():
    from transformers import AutoConfig, AutoProcessor

    from tinyserve.multimodal.vision import load_image_encoder

    for layer, strategy in ((-2, "default"), (-1, "full")):
        path = llava_checkpoint(layer, strategy)
        encoder = load_image_encoder(path, AutoConfig.from_pretrained(path), torch.float32, torch.device("cpu"))
        pixels = AutoProcessor.from_pretrained(path)(text="<image>", images=[image(3)],
                                                     return_tensors="pt")["pixel_values"]
        with torch.no_grad():
            ours = encoder(pixels)
            theirs = hf_llava(str(path)).model.get_image_features(pixel_values=pixels)
        theirs = torch.cat(list(theirs.pooler_output if hasattr(theirs, "pooler_output") else theirs))
        assert ours.shape[1] == ROWS_PER_IMAGE + (strategy == "full")
        torch.testing.assert_close(ours.reshape(theirs.shape), theirs, rtol=1e-5, atol=1e-5)


def test_prompts_with_images_batched_beside_text_give_transformers_greedy_tokens():
    llm = LLM(str(llava_checkpoint()))
    outputs = llm.generate([*(as_prompt(*p) for p in PROMPTS), {"prompt_token_ids": TEXT_ONLY}], GREEDY,
                           use_tqdm=False)
    assert token_ids(outputs[:3]) == expected()
    with torch.no_grad():
        text_only = hf_llava(str(llava_checkpoint())).generate(torch.tensor([TEXT_ONLY]), max_new_tokens=MAX_TOKENS,
                                                                do_sample=False)[0, len(TEXT_ONLY):].tolist()
    assert token_ids(outputs[3:]) == [text_only]
    num_placeholders = [sum(t == llm.model_info.image_token_id for t in o.prompt_token_ids) for o in outputs]
    assert num_placeholders == [ROWS_PER_IMAGE, 2 * ROWS_PER_IMAGE, ROWS_PER_IMAGE, 0]


def test_asyncllm_with_the_engine_in_its_own_process_streams_the_same_tokens():
    """The images cross the wire to the engine process (MultiModalFeature, msgspec) and come out as tokens."""
    import asyncio

    from tinyserve.config import EngineArgs
    from tinyserve.frontend.async_llm import AsyncLLM

    async def main():
        engine = await AsyncLLM.create(EngineArgs(model=str(llava_checkpoint()), num_kv_blocks=64))
        try:
            return [o async for o in engine.generate(as_prompt(*PROMPTS[1]), GREEDY, "two-images")]
        finally:
            engine.shutdown()

    pieces = asyncio.run(main())
    assert len(pieces) > 1 and [t for p in pieces for t in p.outputs[0].token_ids] == expected(PROMPTS[1:2])[0]


def test_chunks_that_cut_through_an_image_and_preemptions_keep_the_tokens():
    """8 tokens a step: each image's 25 placeholders are written over four steps, from the encoder cache
    after the first; 12 blocks of 4 tokens for three requests of 30-65 tokens: they preempt each other."""
    llm = LLM(str(llava_checkpoint()), max_num_batched_tokens=8, block_size=4, num_kv_blocks=24,
              enable_prefix_caching=False)
    outputs = llm.generate([as_prompt(*p) for p in PROMPTS], GREEDY, use_tqdm=False)
    assert token_ids(outputs) == expected()
    cache = llm.engine_core.hooks.parts["multimodal"].cache
    assert cache.hits > 0 and cache.queries > cache.hits  # the later chunks' images came from the cache
    assert llm.engine_core.scheduler.num_preemptions > 0, "the pool is small enough that requests were preempted"


def steps_of(llm: LLM) -> list[dict]:
    """Each step the engine runs from now on: the images it encoded, and each request's tokens, by request id."""
    inputs, steps = llm.engine_core.hooks.parts["multimodal"], []

    def record(step) -> dict:
        steps.append({"encoded": inputs.last_step["encoded"],
                      "tokens": {s.request_id: s.num_new_tokens for s in step.scheduler_output.scheduled}})
        return {}

    llm.engine_core.hooks.post_step.append(record)
    return steps


def test_the_encoder_budget_spreads_a_burst_of_images_over_steps_and_the_text_before_an_image_still_runs():
    """Three one-image prompts arrive together; a step may encode 50 image rows, two images: the third
    request's first chunk stops before its image, and its image is encoded in the next step."""
    prompts = [PROMPTS[0], PROMPTS[2], ("USER: <image> what is this? ASSISTANT:", [image(5, 31, 47)])]
    llm = LLM(str(llava_checkpoint()), max_num_encoder_input_tokens=2 * ROWS_PER_IMAGE, enable_prefix_caching=False)
    steps = steps_of(llm)
    outputs = llm.generate([as_prompt(*p) for p in prompts], GREEDY, use_tqdm=False)
    assert token_ids(outputs) == expected(prompts)
    assert [s["encoded"] for s in steps[:3]] == [2, 1, 0]
    offset = outputs[2].prompt_token_ids.index(llm.model_info.image_token_id)
    third = [s["tokens"].get(outputs[2].request_id) for s in steps[:2]]
    assert third == [offset, len(outputs[2].prompt_token_ids) - offset], "the text before the image, then the rest"
    assert [len(s["tokens"]) for s in steps[:2]] == [3, 3]


def test_an_image_a_running_request_needs_is_never_evicted_and_a_full_cache_holds_the_next_one_back():
    """An encoder cache of one image's rows: a prompt's second image cannot be encoded in the step that needs
    the first (its chunk stops before it), and each image is encoded once, though the cache had room for one."""
    prompts = [PROMPTS[1], PROMPTS[0]]  # two images, then the second of them again
    llm = LLM(str(llava_checkpoint()), encoder_cache_size=ROWS_PER_IMAGE, max_num_batched_tokens=40,
              enable_prefix_caching=False)
    steps = steps_of(llm)
    outputs = llm.generate([as_prompt(*p) for p in prompts], GREEDY, use_tqdm=False)
    assert token_ids(outputs) == expected(prompts)
    assert max(s["encoded"] for s in steps) == 1 and sum(s["encoded"] for s in steps) == 2, steps
    cache = llm.engine_core.hooks.parts["multimodal"].cache
    assert cache.rows <= ROWS_PER_IMAGE and len(cache.entries) == 1


def test_the_same_image_is_a_prefix_cache_and_encoder_cache_hit_and_another_image_is_not():
    llm = LLM(str(llava_checkpoint()), enable_prefix_caching=True, block_size=4)
    text, images = PROMPTS[0]
    [first] = llm.generate([as_prompt(text, images)], GREEDY, use_tqdm=False)
    [again] = llm.generate([as_prompt(text, [image(0)])], GREEDY, use_tqdm=False)  # the same pixels, a new object
    [other] = llm.generate([as_prompt(text, PROMPTS[2][1])], GREEDY, use_tqdm=False)
    assert token_ids([first, again, other]) == [expected()[0], expected()[0], expected()[2]]
    before = first.prompt_token_ids.index(llm.model_info.image_token_id)  # the text before the image: shared
    assert first.num_cached_tokens == 0 and other.num_cached_tokens == before // 4 * 4 < before + 1
    assert again.num_cached_tokens >= len(first.prompt_token_ids) - 4  # every full block but the last token's
    assert token_ids([first]) != token_ids([other])


def test_traced_steps_and_requests_say_which_images_ran_and_the_run_keeps_them_to_replay(tmp_path):
    from tinyserve.lifecycle import schema
    from tinyserve.lifecycle.tracing import keep_images_in, shutdown_tracing
    from tinyserve.multimodal.processor import mm_hash
    from tinyserve.trace_reading import load_run
    from tinyserve.trace_reading.replay import replay_run, why_not_reproducible

    chat = [{"role": "user", "content": [{"type": "image_pil", "image_pil": image(2, 100, 100)},
                                         {"type": "text", "text": "and this?"}]}]
    try:
        # No prefix cache: the second request computes its placeholders again, from the encoder cache (with it,
        # its blocks would be a prefix-cache hit and no step would need the image's rows at all).
        llm = LLM(str(llava_checkpoint()), trace_dir=str(tmp_path / "traces"), enable_prefix_caching=False)
        for text, images in (PROMPTS[0], PROMPTS[0]):
            llm.generate([as_prompt(text, images)], GREEDY, use_tqdm=False)
        [chatted] = llm.chat(chat, GREEDY, use_tqdm=False)
        ids = [*TEXT_ONLY, llm.model_info.image_token_id, 7]  # one placeholder: expanded as the processor would
        [by_ids] = llm.generate([{"prompt_token_ids": ids, "multi_modal_data": {"image": image(1, 64, 32)}}], GREEDY,
                                use_tqdm=False)
        llm.llm_engine.flush_spans()
    finally:
        shutdown_tracing()
        keep_images_in(None)
    [run_dir] = list((tmp_path / "traces").iterdir())
    run = load_run(run_dir)
    queues = [r.sequences[0].stages[schema.QUEUE].attributes for r in run.requests]
    hashes = [mm_hash(image(0))], [mm_hash(image(0))], [mm_hash(image(2, 100, 100))], [mm_hash(image(1, 64, 32))]
    assert [q[schema.MM_HASHES] for q in queues] == list(hashes)
    assert [r.inputs.mm_hashes for r in run.requests] == list(hashes)  # logged on the render span too
    assert [q[schema.MM_PLACEHOLDER_LENGTHS] for q in queues] == [[ROWS_PER_IMAGE]] * 4
    encoding = [(s.span.attributes[schema.STEP_MM_IMAGES_ENCODED], s.span.attributes[schema.STEP_MM_ENCODER_CACHE_HITS])
                for s in run.steps if schema.STEP_MM_IMAGES_ENCODED in s.span.attributes]
    assert encoding[:2] == [(1, 0), (0, 1)], "the first request's step encoded the image, the second's found it"
    encodes = [s for s in run.spans if s.name == schema.ENCODE]  # the encoder's own span, inside execute
    by_id = {s.span_id: s for s in run.spans}
    assert [(e.attributes[schema.MM_HASHES], e.attributes[schema.MM_ENCODER_TOKENS]) for e in encodes][0] == (
        hashes[0], ROWS_PER_IMAGE) and len(encodes) == 3, "image(0), then the chat's and the token ids' images"
    for encode in encodes:
        execute = by_id[encode.parent_span_id]
        assert execute.name == schema.EXECUTE and execute.start_ns <= encode.start_ns <= encode.end_ns <= execute.end_ns
    # offline PIL images, kept as BMP (a copy of their RGB pixels)
    assert sorted(p.name for p in (run_dir / "images").iterdir()) == sorted({f"{h[0]}.bmp" for h in hashes})
    assert run.requests[2].inputs.messages[0]["content"][0]["image_pil"] == "<Image>"  # logged by its type's name
    assert by_ids.prompt_token_ids == TEXT_ONLY + [llm.model_info.image_token_id] * ROWS_PER_IMAGE + [7]
    assert list(chatted.outputs[0].token_ids) == run.requests[2].completions[0].token_ids
    assert all(why_not_reproducible(r, run) is None for r in run.requests)
    results = replay_run(run, LLM(str(llava_checkpoint())))
    assert [r.matched for r in results] == [True] * 4, [r.describe() for r in results]
    (run_dir / "images" / f"{hashes[3][0]}.bmp").unlink()  # a run without an image's pixels: said, not guessed
    assert "not in the run's images/ folder (1 of 1)" in why_not_reproducible(run.requests[3], run)


def test_llm_chat_with_image_parts_gives_transformers_tokens_through_the_processors_template(tmp_path):
    import base64
    import io

    buffer = io.BytesIO()
    image(1).save(buffer, "PNG")
    (tmp_path / "b.png").write_bytes(buffer.getvalue())
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    theirs = hf_chat_greedy(llava_checkpoint(), [
        {"role": "user", "content": [{"type": "image", "image": image(1)}, {"type": "text", "text": "What is it?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "A cat."}]},
        {"role": "user", "content": [{"type": "text", "text": "And this?"},
                                     {"type": "image", "image": image(2, 60, 34)}]},
    ], MAX_TOKENS)
    llm = LLM(str(llava_checkpoint()), allowed_local_media_path=str(tmp_path))
    for first in (url, f"file://{tmp_path / 'b.png'}"):  # the same image, as vLLM's LLM.chat takes either
        messages = [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": first}},
                                         {"type": "text", "text": "What is it?"}]},
            {"role": "assistant", "content": "A cat."},  # a string, shown to the template as one text part
            {"role": "user", "content": [{"type": "text", "text": "And this?"},
                                         {"type": "image_pil", "image_pil": image(2, 60, 34)}]}]
        [output] = llm.chat(messages, GREEDY, use_tqdm=False)
        assert list(output.outputs[0].token_ids) == theirs
    assert output.prompt.count("<image>") == 2 and "ASSISTANT: A cat. USER:" in output.prompt
    with pytest.raises(InvalidInputError, match="is not under the folder") as raised:
        llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "file:///etc/hostname"}}]}],
                 GREEDY, use_tqdm=False)
    assert raised.value.param == "messages[0].content[0].image_url"


@pytest.mark.parametrize("prompt, words", [
    ({"prompt": "no marker", "multi_modal_data": {"image": image(0)}}, "0 <image> marker(s) for 1 image"),
    ({"prompt": "<image> <image>", "multi_modal_data": {"image": image(0)}}, "2 <image> marker(s) for 1 image"),
    ({"prompt": "<image>", "multi_modal_data": {"image": "not an image"}}, "must be a PIL image"),
    ({"prompt": "<image>", "multi_modal_data": {"video": image(0)}}, "takes {'image'"),
    ({"prompt_token_ids": [5, 6], "multi_modal_data": {"image": image(0)}}, "0 image placeholder token"),
    ({"prompt": "<image>", "prompt_token_ids": [5], "multi_modal_data": {"image": image(0)}}, "one of them"),
    ({"prompt": "<image> <image> <image>", "multi_modal_data": {"image": [image(0)] * 3}}, "more than the 2"),
])
def test_bad_image_input_is_refused_naming_multi_modal_data(prompt, words):
    llm = _limited_llm()
    with pytest.raises(InvalidInputError) as raised:
        llm.generate([prompt], GREEDY, use_tqdm=False)
    assert raised.value.param == "multi_modal_data" and words in str(raised.value), str(raised.value)


def test_a_text_only_model_refuses_images_by_name():
    llm = LLM(str(tiny_model_with_tokenizer("llama")))
    with pytest.raises(InvalidInputError, match="this model takes no images") as raised:
        llm.generate([{"prompt": "<image>", "multi_modal_data": {"image": image(0)}}], GREEDY, use_tqdm=False)
    assert raised.value.param == "multi_modal_data"


def test_limit_mm_per_prompt_takes_only_images_offline_and_as_vllms_flag(capsys):
    import argparse

    from tinyserve.cli.engine_flags import add_engine_flags, engine_args_from
    from tinyserve.cli.main import main
    from tinyserve.cli.vllm_flags import add_vllm_flags

    with pytest.raises(ValueError, match="limit_mm_per_prompt"):
        LLM(str(llava_checkpoint()), limit_mm_per_prompt={"video": 1})
    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    add_vllm_flags(parser)
    flags = ["--model", str(llava_checkpoint()), "--limit-mm-per-prompt", '{"image": 2}']
    assert engine_args_from(parser.parse_args(flags)).limit_mm_per_prompt == {"image": 2}
    assert main(["serve", str(llava_checkpoint()), "--limit-mm-per-prompt", '{"image": -1}']) in (1, 2)
    assert "--limit-mm-per-prompt" in capsys.readouterr().err


_limited: list = []


def _limited_llm() -> LLM:
    if not _limited:
        _limited.append(LLM(str(llava_checkpoint()), limit_mm_per_prompt={"image": 2}))
    return _limited[0]


def test_a_traced_run_keeps_an_image_as_the_bytes_it_came_in_else_its_exact_pixels(tmp_path):
    import io

    from PIL import Image

    from tinyserve.lifecycle.tracing import keep_images_in
    from tinyserve.multimodal.media import open_image
    from tinyserve.multimodal.processor import keep_images, mm_hash

    png = io.BytesIO()
    image(4).save(png, "PNG")
    sent = open_image(png.getvalue(), "messages[0].content[0].image_url")
    offline = [image(5), image(6).convert("CMYK"), image(7).convert("LA")]
    keep_images_in(tmp_path)
    try:
        keep_images([sent, *offline], [mm_hash(i) for i in (sent, *offline)])
        keep_images([sent], [mm_hash(sent)])  # once each
    finally:
        keep_images_in(None)
    kept = {p.stem: p for p in (tmp_path / "images").iterdir()}
    assert sorted(p.suffix for p in kept.values()) == [".bmp", ".png", ".tiff", ".tiff"]
    assert kept[mm_hash(sent)].read_bytes() == png.getvalue()  # the bytes as sent, not encoded again
    for picture in (sent, *offline):
        with Image.open(kept[mm_hash(picture)]) as back:
            assert mm_hash(back) == mm_hash(picture)  # the very pixels, mode and size


def test_chat_template_content_format_overrides_what_the_template_syntax_says():
    """vLLM's --chat-template-content-format (LLM(chat_template_content_format=...)): "string" hands LLaVA's
    template, which loops over a message's parts, one string, so it finds no image part in it and the chat is
    refused by name; "openai", what "auto" finds on that template, gives transformers' tokens."""
    conversation = [{"role": "user", "content": [{"type": "image_pil", "image_pil": image(1)},
                                                 {"type": "text", "text": "What is it?"}]}]
    theirs = hf_chat_greedy(llava_checkpoint(), [{"role": "user", "content": [
        {"type": "image", "image": image(1)}, {"type": "text", "text": "What is it?"}]}], MAX_TOKENS)
    for content_format in ("auto", "openai"):
        llm = LLM(str(llava_checkpoint()), chat_template_content_format=content_format)
        [output] = llm.chat(conversation, GREEDY, use_tqdm=False)
        assert list(output.outputs[0].token_ids) == theirs, content_format
    llm = LLM(str(llava_checkpoint()), chat_template_content_format="string")
    with pytest.raises(InvalidInputError, match="0 <image> marker"):
        llm.chat(conversation, GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="chat_template_content_format must be one of"):
        LLM(str(llava_checkpoint()), chat_template_content_format="parts")


def test_the_processor_cache_processes_an_image_once_and_gives_the_same_prompt():
    """vLLM's processor cache: the same image again (another object, the same pixels) is found by its content
    hash, and the processor does not run for it; the prompt and its features are what a fresh processing gives."""
    from tinyserve.multimodal import processor as processing

    from transformers import AutoConfig

    path = llava_checkpoint()
    token = AutoConfig.from_pretrained(path).image_token_index
    cache = processing.PROCESSOR_CACHE
    text = "USER: <image> what? ASSISTANT:"
    before = cache.queries, cache.hits
    first = processing.process(path, token, text, [image(40, 33, 21)])
    again = processing.process(path, token, text, [image(40, 33, 21)])
    assert (cache.queries - before[0], cache.hits - before[1]) == (2, 1)
    assert first[0] == again[0] and first[1] == again[1]
    cache.entries.pop((str(path), first[1][0].identifier))  # gone: processed again, to the same bytes
    assert processing.process(path, token, text, [image(40, 33, 21)]) == first


def test_the_text_before_an_image_is_a_prefix_shared_with_a_prompt_without_it():
    """vLLM's extra keys: an image's hash goes into the blocks its placeholders cover, not into the chain's
    root, so the blocks before the image are the same prefix as the same text alone (and an image after
    the same text and image is found too)."""
    text = "a b c d e f g h i j k l m n o p q r s t u v w x y z a b c d e f g h i j k l m n o p"
    llm = LLM(str(llava_checkpoint()), block_size=8)
    [alone] = llm.generate([{"prompt_token_ids": llm.get_tokenizer()(text).input_ids}], GREEDY, use_tqdm=False)
    [with_image] = llm.generate([as_prompt(text + " <image> and?", [image(3)])], GREEDY, use_tqdm=False)
    before = with_image.prompt_token_ids.index(llm.model_info.image_token_id)
    assert with_image.num_cached_tokens == before // 8 * 8 > 0, (with_image.num_cached_tokens, before)
    [again] = llm.generate([as_prompt(text + " <image> or?", [image(3)])], GREEDY, use_tqdm=False)
    assert again.num_cached_tokens >= before + ROWS_PER_IMAGE - 8  # the image's blocks too, but its last
    [other] = llm.generate([as_prompt(text + " <image> or?", [image(4)])], GREEDY, use_tqdm=False)
    assert other.num_cached_tokens == before // 8 * 8  # another image: the text's blocks only
    assert list(other.outputs[0].token_ids) == expected([(text + " <image> or?", [image(4)])])[0]
