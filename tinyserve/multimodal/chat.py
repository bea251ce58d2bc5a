"""A chat's images: its image parts read (media.py) and shown to the chat template, in the render stage.

    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}},
                                 {"type": "text", "text": "What is this?"}]}

Each image part is read into a PIL image, in the order the chat gives them; the template then sees
the message as its content format takes it (frontend/chat_messages.py's chat_content_format), as vLLM's
chat_utils shows it:

    "openai"   the template loops over a message's content parts (LLaVA's own template does): the parts
               as they came, each image part as {"type": "image"}, for the template to put its marker
    "string"   the template reads a message's content as one string: the image markers ("<image>"),
               one per image, each on a line of its own, before the message's text (vLLM's placement)

The rendered text and the images then go through the checkpoint's processor (processor.py), as a
prompt with multi_modal_data does. The Anthropic messages and Responses handlers hand their image
blocks over as OpenAI image_url parts, so all three take this path.
"""

from tinyserve.errors import InvalidInputError
from tinyserve.multimodal.media import MediaConnector
from tinyserve.multimodal.processor import image_marker, process


def chat_images(messages: list[dict], shown: str, model_info, limit: int | None,
                media: MediaConnector | None) -> tuple[list[dict], list]:
    """The messages as the template takes them (shown: its content format, "openai" or "string";
    frontend/chat_messages.py's chat_content_format), and their images, read, in order. A part's problem is a 400
    naming it (messages[i].content[j]); a model without images, or more images than the limit, is refused
    before any image is read."""
    parts = [part for message in messages if isinstance(message["content"], list)
             for part in message["content"] if part["type"] != "text"]
    if not parts:
        return messages, []
    if model_info.image_token_id is None:
        raise InvalidInputError(f"this model takes no images: {parts[0]['where']} needs an image-text checkpoint "
                                "(LlavaForConditionalGeneration)", parts[0]["where"])
    if limit is not None and len(parts) > limit:
        raise InvalidInputError(f"messages carry {len(parts)} images, more than the {limit} a prompt may carry "
                                "(--limit-mm-per-prompt)", "messages")
    media = media or MediaConnector()
    images = [read_image(part, media) for part in parts]
    marker = image_marker(model_info.path)
    return [_for_template(message, shown, marker) for message in messages], images


def read_image(part: dict, media: MediaConnector):
    """One image part as a PIL image: image_url's URL (a string, or {"url": ...}), or image_pil's image."""
    from PIL import Image

    where = part["where"]
    if part["type"] == "image_pil":
        image = part.get("image_pil")
        if not isinstance(image, Image.Image):
            raise InvalidInputError(f"{where}.image_pil must be a PIL image, got {type(image).__name__}", where)
        return image
    source = part.get("image_url")
    url = source.get("url") if isinstance(source, dict) else source
    return media.load_image(url, f"{where}.image_url")


def _for_template(message: dict, shown: str, marker: str) -> dict:
    content = message["content"]
    if isinstance(content, str):
        return message
    if shown == "openai":
        return {**message, "content": [{"type": "text", "text": p["text"]} if p["type"] == "text"
                                       else {"type": "image"} for p in content]}
    text = "".join(p["text"] for p in content if p["type"] == "text")
    markers = [marker for p in content if p["type"] != "text"]
    return {**message, "content": "\n".join([*markers, text])}


def process_chat(model_info, text: str, images: list):
    """The rendered chat's token ids and image features: its markers must be the images', one for one (a
    message's text that spells the marker itself is refused, as it would take another image's place)."""
    marker = image_marker(model_info.path)
    if text.count(marker) != len(images):
        raise InvalidInputError(f"the rendered chat has {text.count(marker)} {marker} marker(s) for {len(images)} "
                                f"image(s): a message's text may not spell {marker} itself", "messages")
    return process(model_info.path, model_info.image_token_id, text, images, add_special_tokens=False)
