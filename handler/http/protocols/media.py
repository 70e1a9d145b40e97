"""Images in requests: every protocol's image part -> one `ImageInput` (decoded, checked, hashed).

  Chat Completions / LMI's chat on /invocations   {"type": "image_url", "image_url": {"url", "detail"}}
  Anthropic Messages                              {"type": "image", "source": {"type": "base64", ...}}
  Responses                                       {"type": "input_image", "image_url", "detail"}

The Messages and Responses translations (anthropic.py, responses.py) turn their parts into Chat
Completions' `image_url` parts carrying `WHERE` (the part's own field in their body), so one parser
(openai.parse_chat) decodes every image, and every error names the field the client sent.

A URL is a `data:` URL (base64), or http(s) when option.allow_remote_images is on. Limits
(serving.properties): option.max_image_mb (the encoded bytes), option.max_image_pixels (checked
from the header, before the pixels are decoded), option.max_images_per_request. Each is a 400
naming the part and the limit. Pillow decodes; nothing here imports torch.

In the rendered prompt an image is the template's own placeholder (a template that loops over
`content` gets `{"type": "image"}` parts) or, for a template that takes text, `MARKER` where the
part stood; the model's processor (handler/model/vision.py) turns either into its image tokens.
"""
from __future__ import annotations

import base64
import binascii
import hashlib
import io
import re
from dataclasses import dataclass
from typing import Any

from handler.engine.request import RequestError, show
from handler.engine.types import IMAGE_MARKER

WHERE = "lmi_where"            # a translated part's own field in its protocol's body (errors)
MARKER = IMAGE_MARKER           # an image's place in a text-only template's prompt
DETAILS = ("auto", "low", "high")
_DATA_URL = re.compile(r"data:(?P<type>[\w.+-]+/[\w.+-]+)?(?P<params>(?:;[\w.+-]+=[\w.+-]+)*)(?P<b64>;base64)?,",
                       re.IGNORECASE)


@dataclass(frozen=True)
class Limits:
    """What the server takes (serving.properties; handler/config/schema.py documents each)."""
    remote: bool = False            # option.allow_remote_images
    max_bytes: int = 5_000_000      # option.max_image_mb
    max_pixels: int = 16_777_216    # option.max_image_pixels
    max_images: int = 8             # option.max_images_per_request
    fetch_timeout_s: float = 10.0   # option.image_fetch_timeout

    @classmethod
    def of(cls, cfg) -> "Limits":
        d = cls()
        return cls(bool(getattr(cfg, "allow_remote_images", d.remote)),
                   int(getattr(cfg, "max_image_mb", d.max_bytes / 1e6) * 1e6),
                   int(getattr(cfg, "max_image_pixels", d.max_pixels)),
                   int(getattr(cfg, "max_images_per_request", d.max_images)),
                   float(getattr(cfg, "image_fetch_timeout_s", d.fetch_timeout_s)))


@dataclass(frozen=True)
class ImageInput:
    """One decoded image of a request, in the order its parts came."""
    where: str                  # the request field of its part, e.g. messages[1].content[0]
    image: Any                  # PIL.Image.Image, RGB
    hash: str                   # sha256 of its decoded pixels (mode, size, bytes): the encoder and prefix caches' key
    detail: str = "auto"


def _mb(n: int) -> str:
    return f"{n / 1e6:.3g} MB"


def _data_url(url: str, where: str, limits: Limits) -> bytes:
    m = _DATA_URL.match(url)
    if m is None or not m.group("b64"):
        raise RequestError(where, "must be a base64 data: URL (data:image/png;base64,...), got "
                                  f"{show(url[:40])}")
    payload = url[m.end():]
    # 4 base64 characters carry 3 bytes: refuse a payload too large before decoding it
    if len(payload) * 3 // 4 > limits.max_bytes + 3:
        raise RequestError(where, f"the image is about {_mb(len(payload) * 3 // 4)}, over "
                                  f"option.max_image_mb={limits.max_bytes / 1e6:g}")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise RequestError(where, "is not valid base64 after the data: URL's comma") from None
    return data


def _fetch(url: str, where: str, limits: Limits) -> bytes:
    import urllib.error
    import urllib.request
    try:
        with urllib.request.urlopen(url, timeout=limits.fetch_timeout_s) as r:   # noqa: S310 (http(s) only)
            data = r.read(limits.max_bytes + 1)
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise RequestError(where, f"could not fetch {show(url[:200])}: {str(e)[:200]}") from None
    return data


def read(url, where: str, limits: Limits, detail=None, detail_where: str | None = None) -> ImageInput:
    """An image part's URL -> ImageInput; RequestError (400, naming `where` and the limit) otherwise.
    `detail` (OpenAI's auto / low / high) is checked and kept: the families served so far have one
    resolution."""
    if detail is not None and detail not in DETAILS:
        raise RequestError(detail_where or f"{where}.detail", f"must be one of {', '.join(DETAILS)}, got {show(detail)}")
    if not isinstance(url, str) or not url:
        raise RequestError(where, f"must be an image URL (a base64 data: URL), got {show(url)}")
    scheme = url[:8].lower()
    if scheme.startswith("data:"):
        data = _data_url(url, where, limits)
    elif scheme.startswith(("http://", "https://")):
        if not limits.remote:
            raise RequestError(where, "is a remote URL, and fetching remote images is off on this server "
                                      "(option.allow_remote_images=false): send the image as a base64 data: URL")
        data = _fetch(url, where, limits)
    else:
        raise RequestError(where, f"must be a base64 data: URL (or http(s) with option.allow_remote_images), "
                                  f"got {show(url[:40])}")
    if len(data) > limits.max_bytes:
        raise RequestError(where, f"the image is {_mb(len(data))}, over option.max_image_mb="
                                  f"{limits.max_bytes / 1e6:g}")
    return ImageInput(where, *decode(data, where, limits), detail=detail or "auto")


def decode(data: bytes, where: str, limits: Limits):
    """Bytes -> (RGB image, content hash): the size is checked from the header first."""
    from PIL import Image
    try:
        img = Image.open(io.BytesIO(data))
        w, h = img.size
    except Exception:       # Pillow raises many kinds (UnidentifiedImageError, SyntaxError, ...)
        raise RequestError(where, f"is not an image this server can decode ({len(data)} bytes; PNG, JPEG, "
                                  "WebP, GIF, BMP and TIFF are)") from None
    if w * h > limits.max_pixels:
        raise RequestError(where, f"the image is {w}x{h} = {w * h} pixels, over option.max_image_pixels="
                                  f"{limits.max_pixels}")
    try:
        img.load()
        img = img.convert("RGB")
    except Exception:
        raise RequestError(where, f"is a {img.format or 'an'} image that cannot be decoded (truncated or "
                                  "corrupt)") from None
    digest = hashlib.sha256(f"{img.mode}:{w}x{h}:".encode())
    digest.update(img.tobytes())
    return img, digest.hexdigest()


def check_room(taken: int, where: str, limits: Limits) -> None:
    """Before decoding another image: `taken` images so far in this request."""
    if taken >= limits.max_images:
        raise RequestError(where, f"is image {taken + 1} of this request; at most {limits.max_images} are "
                                  f"taken (option.max_images_per_request={limits.max_images})")


def to_text_only(images: list[ImageInput]) -> RequestError:
    """The error for images sent to a model that reads text only."""
    return RequestError(images[0].where, "is an image, and this server's model reads text only (a vision-language "
                                         "model, e.g. LLaVA, takes images)")


def data_url(media_type: str, b64: str) -> str:
    return f"data:{media_type};base64,{b64}"
