"""Images in prompts: how a dataset names them and the one form they travel in.

A task's chat messages hold OpenAI-style content parts; each image is an ``{"type": "image"}``
part (the placeholder chat templates render as the model's image token), and the task carries
the images themselves, in order, as PNG bytes (``Task.images``). A JSONL dataset names an image
as a file path relative to the dataset file (``{"type": "image", "image": "img/0.png"}``) or a
data URL (``{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}``); remote
URLs are refused (a dataset is read where the run starts, and its pixels must not change under
the learner). Pillow is imported on first use.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

__all__ = [
    "IMAGE_PART",
    "IMAGE_TOKEN_BIAS",
    "MAX_IMAGE_BYTES",
    "ImageError",
    "count_images",
    "decode_data_url",
    "image_digest",
    "image_token_ids",
    "open_image",
    "png_bytes",
    "read_image",
    "resolve_parts",
    "text_of",
]

IMAGE_PART = {"type": "image"}  # a content part standing for the task's next image
MAX_IMAGE_BYTES = 16 << 20  # one encoded image file or data URL payload
MAX_IMAGE_PIXELS = 4096 * 4096  # decoded size: a small file can still decompress to gigabytes


# What samplers and the learner add to the logits of image tokens (vLLM's lowest logit bias):
# a model never writes an image marker as text, and both sides score the same distribution.
IMAGE_TOKEN_BIAS = -100.0


class ImageError(ValueError):
    """An image reference or image file that cannot be used; the message names it."""


def decode_data_url(url: str) -> bytes:
    """The bytes of a base64 ``data:image/...`` URL."""
    head, sep, payload = url.partition(",")
    if not sep or not head.startswith("data:image/") or not head.endswith(";base64"):
        raise ImageError(f"not a base64 image data URL: {url[:40]!r}")
    if len(payload) > MAX_IMAGE_BYTES * 4 // 3 + 4:
        raise ImageError(f"image data URL over {MAX_IMAGE_BYTES} bytes")
    try:
        return base64.b64decode(payload, validate=True)
    except binascii.Error as exc:
        raise ImageError(f"image data URL is not valid base64: {exc}") from None


def read_image(reference: str, base: Path) -> bytes:
    """PNG bytes of a data URL or of a file path (relative to ``base``), checked to decode."""
    if reference.startswith("data:"):
        data = decode_data_url(reference)
    elif "://" in reference:
        raise ImageError(f"remote image {reference!r}: give a file path or a data URL")
    else:
        path = base / reference
        try:
            size = path.stat().st_size
        except OSError as exc:
            raise ImageError(f"image file {path}: {exc.strerror}") from None
        if size > MAX_IMAGE_BYTES:
            raise ImageError(f"image file {path} is {size} bytes, over {MAX_IMAGE_BYTES}")
        data = path.read_bytes()
    return png_bytes(open_image(data, name=reference[:60]))


def open_image(data: bytes, *, name: str = "image") -> Any:
    """The decoded RGB PIL image of encoded bytes (any format Pillow reads)."""
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as image:
            if image.width * image.height > MAX_IMAGE_PIXELS:
                raise ImageError(
                    f"{name}: {image.width}x{image.height} pixels, over {MAX_IMAGE_PIXELS}"
                )
            return image.convert("RGB")
    except (OSError, Image.DecompressionBombError) as exc:
        raise ImageError(f"{name}: not a readable image ({exc})") from None


def png_bytes(image: Any) -> bytes:
    """A PIL image as PNG bytes: lossless, so the learner sees the sampler's exact pixels."""
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def image_digest(data: bytes) -> str:
    """The content hash images are named by when they travel by reference."""
    return hashlib.sha256(data).hexdigest()


def resolve_parts(content: Any, base: Path, images: list[bytes]) -> str | list[dict[str, Any]]:
    """A message's content with every image part made ``IMAGE_PART`` and its PNG bytes appended
    to ``images``; a string stays a string. ImageError names a malformed part."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list) or not content:
        raise ImageError("content must be a string or a non-empty list of parts")
    parts: list[dict[str, Any]] = []
    for index, part in enumerate(content):
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind == "text" and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "image" and isinstance(part.get("image"), str):
            images.append(read_image(part["image"], base))
            parts.append(dict(IMAGE_PART))
        elif kind == "image_url" and isinstance((part.get("image_url") or {}).get("url"), str):
            images.append(read_image(part["image_url"]["url"], base))
            parts.append(dict(IMAGE_PART))
        else:
            raise ImageError(
                f"content part {index}: expected {{type: text, text}}, {{type: image, image: "
                f"PATH}} or {{type: image_url, image_url: {{url}}}}, got {part!r:.80}"
            )
    return parts


def count_images(messages: Iterable[Mapping[str, Any]]) -> int:
    """Image parts in chat messages."""
    return sum(
        1
        for message in messages
        if isinstance(message.get("content"), list)
        for part in message["content"]
        if part.get("type") in ("image", "image_url")
    )


def text_of(content: Any) -> str:
    """The text of a message's content: the string, or its text parts joined."""
    if isinstance(content, str):
        return content
    return "".join(p.get("text", "") for p in content or () if p.get("type") == "text")


def image_token_ids(processor: Any) -> tuple[int, ...]:
    """The token ids a vision-language model's processor writes for an image (the image token
    and the markers around it), found by expanding one blank image: what the model must never
    generate (text cannot stand for pixels, and a stray image token breaks the next forward)."""
    from PIL import Image

    tokenizer = processor.tokenizer
    marker = str(processor.image_token)
    blank = Image.new("RGB", (32, 32))
    expanded = processor(text=[f"a{marker}"], images=[[blank]], add_special_tokens=False)
    plain = set(tokenizer("a", add_special_tokens=False)["input_ids"])
    ids = {int(i) for i in expanded["input_ids"][0]} - plain
    ids.add(int(tokenizer.convert_tokens_to_ids(marker)))
    return tuple(sorted(ids))
