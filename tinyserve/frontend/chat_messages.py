"""A chat's messages as the chat template takes them: each one checked, and the template's content format.

    normalize_message     {"role", "content": a string, or text and image parts, ...} checked, each
                          problem a 400 naming messages[i] (its part, its field); text parts joined,
                          image parts kept for tinyserve/multimodal/chat.py to read
    chat_content_format   whether the template loops over a message's content parts ("openai") or
                          reads it as one string ("string"), as vLLM detects it

The render stage (render.py) calls both before the template renders the chat.
"""

import functools

from tinyserve.errors import InvalidInputError

# A chat's image parts: OpenAI's ({"type": "image_url", "image_url": {"url": ...}}), and vLLM's offline
# {"type": "image_pil", "image_pil": PIL.Image} (LLM.chat); read by tinyserve/multimodal/chat.py
IMAGE_PARTS = ("image_url", "image_pil")
CHAT_ROLES = ("system", "user", "assistant", "developer", "tool")  # the usual ones; a template may take others


CONTENT_FORMATS = ("auto", "string", "openai")  # vLLM's --chat-template-content-format


@functools.lru_cache(maxsize=16)
def chat_content_format(template: str) -> str:
    """How a chat template reads a message's content, found on its Jinja syntax tree as vLLM finds it (its
    --chat-template-content-format "auto"): "openai" when it loops over the content (`for part in
    message['content']`, filtered or not: LLaVA's template does), each message's content is then a list of
    parts; else "string", each message's content one string."""
    from jinja2 import Environment, nodes

    try:
        tree = Environment().parse(template)
    except Exception:  # the template's own error is reported when it renders
        return "string"
    for loop in tree.find_all(nodes.For):
        source = loop.iter
        while isinstance(source, (nodes.Filter, nodes.Test)):
            source = source.node
        if (isinstance(source, nodes.Getitem) and isinstance(source.arg, nodes.Const) and source.arg.value == "content"
                or isinstance(source, nodes.Getattr) and source.attr == "content"):
            return "openai"
    return "string"


def normalize_message(index: int, message) -> dict:
    """messages[index] checked: its role, its content (a string, or text and image parts), the optional fields."""
    if not isinstance(message, dict):
        raise InvalidInputError(f"messages[{index}] must be an object with 'role' and 'content'")
    role = message.get("role")
    if not isinstance(role, str) or not role:  # any other role goes to the chat template, as in vLLM
        raise InvalidInputError(f"messages[{index}].role must be a non-empty string (such as one of {CHAT_ROLES}), "
                         f"got {role!r}")
    content = message.get("content")
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if isinstance(part, dict) and part.get("type") in IMAGE_PARTS:
                parts.append({**part, "where": f"messages[{index}].content[{j}]"})  # read by multimodal/chat.py
            elif not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise InvalidInputError(f"messages[{index}].content[{j}] must be a text part {{'type': 'text', "
                                        f"'text': ...}} or an image part {{'type': 'image_url', 'image_url': "
                                        f"{{'url': ...}}}}", f"messages[{index}].content[{j}]")
            else:
                parts.append(part["text"])
        images = any(isinstance(part, dict) for part in parts)
        content = [part if isinstance(part, dict) else {"type": "text", "text": part} for part in parts] \
            if images else "".join(parts)
    if not isinstance(content, (str, list)):
        raise InvalidInputError(f"messages[{index}].content must be a string or a list of text parts")
    normalized = {"role": role, "content": content}
    # reasoning, reasoning_content: an assistant turn's reasoning, for a reasoning model's template (vLLM's names)
    for key, kind in (("name", str), ("tool_call_id", str), ("tool_calls", list), ("reasoning", str),
                      ("reasoning_content", str)):
        if message.get(key) is not None:
            if not isinstance(message[key], kind):
                raise InvalidInputError(f"messages[{index}].{key} must be a {'string' if kind is str else 'list'}")
            normalized[key] = message[key]
    return normalized
