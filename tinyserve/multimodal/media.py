"""Where a chat's images come from: an image part's URL read into a PIL image, in the render stage.

    data:image/png;base64,...     decoded (the bytes at most MAX_IMAGE_BYTES)
    file:///srv/images/cat.png    read only under --allowed-local-media-path (the path resolved first,
                                  so that "..", or a link out of the folder, is refused)
    https://host/cat.png          fetched only from a host --allowed-media-domains names, within
                                  MEDIA_FETCH_TIMEOUT_S, no redirects followed (a redirect would lead
                                  anywhere); a server never fetches whatever a client names

The names are vLLM's flags. Every image is opened by Pillow and checked before anything else reads
it: at most MAX_IMAGE_PIXELS pixels (a small file can claim a huge image), and its pixels decoded
whole (a truncated or corrupt file is found here, not in the processor). Each refusal is an
InvalidInputError naming the part it came from, the API's 400.

What Pillow does for us: it reads every image format a client may send (PNG, JPEG, WebP, GIF, ...),
and tells the image's size from its header before it decodes the pixels.
"""

import base64
import binascii
import io
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path

from tinyserve.errors import InvalidInputError

MAX_IMAGE_BYTES = 20 * 1024 * 1024  # an encoded image, as sent or read
SOURCE_BYTES = "tinyserve.source_bytes"  # the image's info key: the bytes it was decoded from (processor.keep_images)
MAX_IMAGE_PIXELS = 4096 * 4096  # width x height
MEDIA_FETCH_TIMEOUT_S = 5.0  # vLLM's VLLM_IMAGE_FETCH_TIMEOUT


@dataclass(frozen=True)
class MediaConnector:
    """The server's --allowed-local-media-path and --allowed-media-domains; `load_image(url, field)`."""

    allowed_local_media_path: str | None = None
    allowed_media_domains: tuple[str, ...] = field(default_factory=tuple)

    def load_image(self, url, where: str):
        """The image a part's URL names, opened and checked; where: the part, as the 400 names it."""
        if not isinstance(url, str) or not url:
            raise InvalidInputError(f"{where} must be a URL string (data:, file: or http(s):)", where)
        scheme = url.split(":", 1)[0].lower() if ":" in url else ""
        if scheme == "data":
            return open_image(_data_url_bytes(url, where), where)
        if scheme == "file":
            return open_image(self._local_bytes(url, where), where)
        if scheme in ("http", "https"):
            return open_image(self._fetched_bytes(url, where), where)
        raise InvalidInputError(f"{where} must be a data:, file: or http(s): URL, got {url[:40]!r}", where)

    def _local_bytes(self, url: str, where: str) -> bytes:
        if not self.allowed_local_media_path:
            raise InvalidInputError(f"{where}: file: URLs are read only from the folder the server allows "
                                    "(--allowed-local-media-path), and it allows none", where)
        parsed = urllib.parse.urlparse(url)
        if parsed.netloc not in ("", "localhost"):
            raise InvalidInputError(f"{where}: a file: URL names no host, got {parsed.netloc!r}", where)
        folder = Path(self.allowed_local_media_path).resolve()
        path = Path(urllib.parse.unquote(parsed.path)).resolve()
        if not path.is_relative_to(folder):
            raise InvalidInputError(f"{where}: {path} is not under the folder the server allows "
                                    f"(--allowed-local-media-path {folder})", where)
        try:
            with path.open("rb") as file:
                data = file.read(MAX_IMAGE_BYTES + 1)
        except OSError as error:
            raise InvalidInputError(f"{where}: {path} cannot be read: {error.strerror or error}", where) from None
        return _bounded(data, where)

    def _fetched_bytes(self, url: str, where: str) -> bytes:
        import httpx

        host = urllib.parse.urlparse(url).hostname or ""
        if host.lower() not in {domain.lower() for domain in self.allowed_media_domains}:
            allowed = ", ".join(self.allowed_media_domains) or "none"
            raise InvalidInputError(f"{where}: {host or url[:40]!r} is not a domain the server fetches images from "
                                    f"(--allowed-media-domains: {allowed})", where)
        try:
            with httpx.stream("GET", url, timeout=MEDIA_FETCH_TIMEOUT_S, follow_redirects=False) as answer:
                if answer.status_code != 200:
                    raise InvalidInputError(f"{where}: GET {url} answered {answer.status_code}", where)
                data = bytearray()
                for chunk in answer.iter_bytes():
                    data += chunk
                    if len(data) > MAX_IMAGE_BYTES:
                        break
        except httpx.HTTPError as error:
            raise InvalidInputError(f"{where}: GET {url} failed: {type(error).__name__}: {error}", where) from None
        return _bounded(bytes(data), where)


def _data_url_bytes(url: str, where: str) -> bytes:
    """data:<media type>;base64,<data> → its bytes; an image's media type, base64 only."""
    header, comma, data = url.partition(",")
    media_type, *params = header[len("data:"):].split(";")
    if not comma or "base64" not in params:
        raise InvalidInputError(f"{where}: a data URL must be data:image/...;base64,<data>", where)
    if not media_type.lower().startswith("image/"):
        raise InvalidInputError(f"{where}: a data URL of {media_type or 'no media type'!r} is not an image "
                                "(data:image/...)", where)
    if len(data) > (MAX_IMAGE_BYTES * 4) // 3 + 4:
        raise InvalidInputError(f"{where}: the image is more than {MAX_IMAGE_BYTES} bytes", where)
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidInputError(f"{where}: the data URL's data is not valid base64", where) from None


def _bounded(data: bytes, where: str) -> bytes:
    if len(data) > MAX_IMAGE_BYTES:
        raise InvalidInputError(f"{where}: the image is more than {MAX_IMAGE_BYTES} bytes", where)
    return data


def open_image(data: bytes, where: str):
    """The bytes as a PIL image, its pixels decoded, or a 400 saying why not."""
    from PIL import Image, UnidentifiedImageError

    try:
        image = Image.open(io.BytesIO(data))
    except Image.DecompressionBombError:
        raise InvalidInputError(f"{where}: the image has more than the {MAX_IMAGE_PIXELS} pixels an image may have",
                                where) from None
    except (UnidentifiedImageError, OSError, ValueError):
        raise InvalidInputError(f"{where}: the data is not an image Pillow can read", where) from None
    width, height = image.size
    if width * height > MAX_IMAGE_PIXELS:
        raise InvalidInputError(f"{where}: the image is {width}x{height}, more than the {MAX_IMAGE_PIXELS} pixels "
                                "an image may have", where)
    try:
        image.load()
    except (OSError, ValueError, SyntaxError) as error:
        raise InvalidInputError(f"{where}: the image cannot be decoded: {error}", where) from None
    image.info[SOURCE_BYTES] = data  # what a traced run keeps of it: the bytes decode to these very pixels
    return image
