"""Images over HTTP: a chat's image parts through `tinyserve serve` of a LLaVA checkpoint, as the clients send them.

One server of tests/llava_checkpoints.py's tiny LLaVA (its processor carries llava-1.5's chat template),
with --limit-mm-per-prompt {"image": 2}, a folder for file: URLs (--allowed-local-media-path) and a
loopback image server it may fetch from (--allowed-media-domains 127.0.0.1). A chat with images, sent
by the official openai client (chat completions, streamed and not, and Responses' input_image) and the
anthropic client (a base64 image block), gives transformers' greedy tokens for the same conversation
through the processor's own chat template; the image as a data: URL, a file: URL and an http: URL is
the same image. The same image under another prefix is an encoder cache hit on /metrics (vLLM's
mm_cache_queries, mm_cache_hits). Every bad image is a 400 naming the part it came from, and a
text-only model refuses one.
"""

import base64
import http.server
import io
import threading

import anthropic
import httpx
import openai
import pytest

from tests import shared_server
from tests.server_checks import wait_until
from tests.llava_checkpoints import hf_chat_greedy, image, llava_checkpoint
from tinyserve.testing import ServerProcess

pytestmark = pytest.mark.server

MODEL = "llava"
MAX_TOKENS = 8
QUESTION = "What is this?"


def png(picture) -> bytes:
    buffer = io.BytesIO()
    picture.save(buffer, "PNG")
    return buffer.getvalue()


def data_url(picture) -> str:
    return "data:image/png;base64," + base64.b64encode(png(picture)).decode()


class ImageHost:
    """A loopback HTTP server of images: /a.png, and /moved that redirects to it."""

    def __init__(self, files: dict[str, bytes]) -> None:
        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                if self.path == "/moved":
                    self.send_response(302)
                    self.send_header("Location", "/a.png")
                    self.end_headers()
                    return
                body = files.get(self.path.lstrip("/"))
                self.send_response(200 if body is not None else 404)
                self.send_header("Content-Length", str(len(body or b"")))
                self.end_headers()
                self.wfile.write(body or b"")

            def log_message(self, *args):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    folder = tmp_path_factory.mktemp("media")
    (folder / "a.png").write_bytes(png(image(1)))
    host = ImageHost({"a.png": png(image(1))})
    yield folder, host
    host.stop()


@pytest.fixture(scope="module")
def llava_server(media):
    folder, _ = media
    server = ServerProcess(str(llava_checkpoint()), "--served-model-name", MODEL, "--metrics-prefix", "vllm",
                           "--limit-mm-per-prompt",
                           '{"image": 2}', "--allowed-local-media-path", str(folder),
                           "--allowed-media-domains", "127.0.0.1")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def expected_text() -> str:
    """transformers' greedy answer to [image(1), QUESTION], through the processor's chat template, as text."""
    from transformers import AutoTokenizer

    tokens = hf_chat_greedy(llava_checkpoint(), [{"role": "user", "content": [
        {"type": "image", "image": image(1)}, {"type": "text", "text": QUESTION}]}], MAX_TOKENS)
    return AutoTokenizer.from_pretrained(llava_checkpoint()).decode(tokens)


def chat(server, content: list, **fields) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/chat/completions", timeout=120, json={
        "model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": MAX_TOKENS,
        "temperature": 0, **fields})


def image_part(url: str, **fields) -> dict:
    return {"type": "image_url", "image_url": {"url": url, **fields}}


def test_a_chat_with_an_image_gives_transformers_tokens_over_openai_anthropic_and_responses(
        llava_server, media, expected_text):
    folder, host = media
    client = openai.OpenAI(base_url=f"{llava_server.url}/v1", api_key="unused", max_retries=0)
    for url in (data_url(image(1)), f"file://{folder / 'a.png'}", f"{host.url}/a.png"):
        messages = [{"role": "user", "content": [image_part(url), {"type": "text", "text": QUESTION}]}]
        answer = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0)
        assert answer.choices[0].message.content == expected_text, url[:40]
    assert answer.usage.prompt_tokens > 25  # the image's 25 placeholders are prompt tokens
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0,
                                            stream=True)
    assert "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices) == expected_text

    response = client.responses.create(model=MODEL, max_output_tokens=MAX_TOKENS, temperature=0, input=[
        {"role": "user", "content": [{"type": "input_image", "image_url": data_url(image(1))},
                                     {"type": "input_text", "text": QUESTION}]}])
    assert response.output_text == expected_text

    claude = anthropic.Anthropic(base_url=llava_server.url, api_key="unused", max_retries=0)
    message = claude.messages.create(model=MODEL, max_tokens=MAX_TOKENS, extra_body={"temperature": 0}, messages=[
        {"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(png(image(1))).decode()}},
            {"type": "text", "text": QUESTION}]}])
    assert message.content[0].text == expected_text


def mm_cache_counts(server) -> tuple[float, float]:
    """vllm:mm_cache_queries_total and vllm:mm_cache_hits_total, summed over the engines."""
    from prometheus_client.parser import text_string_to_metric_families

    totals = {"vllm:mm_cache_queries": 0.0, "vllm:mm_cache_hits": 0.0}
    for family in text_string_to_metric_families(httpx.get(f"{server.url}/metrics", timeout=30).text):
        if family.name in totals:
            totals[family.name] = sum(s.value for s in family.samples if s.name.endswith("_total"))
    return totals["vllm:mm_cache_queries"], totals["vllm:mm_cache_hits"]


def test_an_image_seen_before_under_another_prefix_is_an_encoder_cache_hit_on_metrics(llava_server):
    fresh = [image_part(data_url(image(77, 44, 31))), {"type": "text", "text": QUESTION}]
    queries, hits = mm_cache_counts(llava_server)
    assert chat(llava_server, fresh).status_code == 200
    # The same chat again would be a prefix cache hit up to its last token, which is text: no image is looked up.
    # Another text before the image is another prefix; its image is found in the encoder cache.
    again = httpx.post(f"{llava_server.url}/v1/chat/completions", timeout=120, json={
        "model": MODEL, "max_tokens": MAX_TOKENS, "messages": [{"role": "system", "content": "Be brief."},
                                                               {"role": "user", "content": fresh}]})
    assert again.status_code == 200 and again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    # one lookup each (each prompt fits one step): a miss, then a hit; the metrics follow the engine's report
    wait_until(lambda: mm_cache_counts(llava_server) == (queries + 2, hits + 1), 30, "the counters are reported")


def big_png() -> bytes:
    from PIL import Image

    return png(Image.new("RGB", (5000, 4000)))


BAD_PARTS = [  # (the image part, what the 400 says)
    (image_part("data:text/plain;base64,aGVsbG8="), "'text/plain' is not an image"),
    (image_part("data:image/png;base64," + base64.b64encode(b"not a png").decode()), "not an image Pillow can read"),
    (image_part("data:image/png;base64,@@@@"), "not valid base64"),
    (image_part("data:image/png;base64," + base64.b64encode(png(image(1))[:300]).decode()), "cannot be decoded"),
    (image_part("file:///etc/hostname"), "is not under the folder the server allows"),
    (image_part("http://example.com/a.png"), "'example.com' is not a domain the server fetches images from"),
    (image_part("ftp://127.0.0.1/a.png"), "must be a data:, file: or http(s): URL"),
]


@pytest.mark.parametrize("part, words", BAD_PARTS, ids=[words.split()[0].strip("'") + str(i)
                                                       for i, (_, words) in enumerate(BAD_PARTS)])
def test_a_bad_image_part_is_a_400_naming_it(llava_server, part, words):
    refused = chat(llava_server, [{"type": "text", "text": QUESTION}, part])
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert words in error["message"] and error["param"] == "messages[0].content[1].image_url", error


def test_images_past_the_bounds_and_the_limit_are_refused_and_the_server_keeps_serving(
        llava_server, media, expected_text):
    _, host = media
    for part, words, param in [
            (image_part(f"{host.url}/moved"), "answered 302", "messages[0].content[0].image_url"),
            (image_part(f"{host.url}/missing.png"), "answered 404", "messages[0].content[0].image_url"),
            (image_part("data:image/png;base64," + base64.b64encode(big_png()).decode()),
             "is 5000x4000, more than the", "messages[0].content[0].image_url"),
            (image_part(data_url(image(1)), detail="low"), "auto", "messages.0.content.list.0.image_url.detail")]:
        refused = chat(llava_server, [part, {"type": "text", "text": QUESTION}])
        assert refused.status_code == 400 and words in refused.json()["error"]["message"], refused.text
        assert param.replace(".list", "") in refused.json()["error"]["param"].replace(".list", ""), refused.text
    three = [image_part(data_url(image(i))) for i in range(3)]
    refused = chat(llava_server, [*three, {"type": "text", "text": QUESTION}])
    assert refused.status_code == 400 and "3 images, more than the 2" in refused.json()["error"]["message"]
    typed = chat(llava_server, [image_part(data_url(image(1))), {"type": "text", "text": "look: <image>"}])
    assert typed.status_code == 400 and "may not spell <image>" in typed.json()["error"]["message"], typed.text
    answer = chat(llava_server, [image_part(data_url(image(1))), {"type": "text", "text": QUESTION}])
    assert answer.json()["choices"][0]["message"]["content"] == expected_text


def test_a_text_only_model_refuses_an_image_part_by_name(server):
    refused = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
        "model": shared_server.MODEL, "max_tokens": 2, "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Hi"}, image_part(data_url(image(1)))]}]})
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert "this model takes no images" in error["message"] and error["param"] == "messages[0].content[1]", error
