"""Images in chat requests: OpenAI ``image_url`` content parts to the sampler's ``Image`` bytes.

A data URL is decoded here. A remote (http or https) URL is fetched only from a host the
settings list (``limits.image_url_hosts``): otherwise any client could make the gateway request
whatever address it names, from inside the network the gateway runs in. Every image is checked
to decode, in a format the samplers take and within the size and pixel limits, before a sampler
sees it, so a bad image is a 400 naming its part rather than a sampler error naming none.

The functions raise ``BadRequest`` whose ``param`` is the part's field
(``messages[0].content[1].image_url.url``); the serving class only strings them together.
"""

from __future__ import annotations

import asyncio
import io
from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

from common.images import ImageError, decode_data_url, open_image
from gateway.errors import BadRequest
from gateway.openai.protocol import ChatMessage
from gateway.settings import Limits

__all__ = [
    "FORMATS",
    "ImageRef",
    "check_count",
    "check_image",
    "data_url_image",
    "fetch_image",
    "image_refs",
    "load_images",
    "remote_url",
]

# What the sampler's Image.data takes (sampler.proto); Pillow names them so.
FORMATS = frozenset({"PNG", "JPEG", "WEBP", "GIF", "BMP"})


@dataclass(frozen=True)
class ImageRef:
    """One image part of a request: its message, its part and its URL."""

    message: int
    part: int
    url: str

    @property
    def param(self) -> str:
        return f"messages[{self.message}].content[{self.part}].image_url.url"


def _refuse(param: str, problem: str) -> BadRequest:
    return BadRequest(f"{param}: {problem}", param=param)


def image_refs(messages: Sequence[ChatMessage]) -> list[ImageRef]:
    """Every image part of the messages, in order. Parts other than text and images, and
    images outside user messages (OpenAI takes them in user messages only), are refused."""
    refs = []
    for i, message in enumerate(messages):
        if isinstance(message.content, str) or message.content is None:
            continue
        for j, part in enumerate(message.content):
            where = f"messages[{i}].content[{j}]"
            if part.type == "text":
                if part.text is None:
                    raise _refuse(where, "a text part needs `text`")
            elif part.type == "image_url":
                if part.image_url is None:
                    raise _refuse(where, "an image_url part needs `image_url` with a `url`")
                if message.role != "user":
                    raise _refuse(where, "images are accepted in user messages only")
                refs.append(ImageRef(i, j, part.image_url.url))
            else:
                raise BadRequest(
                    f"{where}: content parts of type {part.type!r} are not supported "
                    "(text and image_url only)",
                    param=where,
                )
    return refs


def check_count(refs: Sequence[ImageRef], *, model_max: int, limit: int | None) -> None:
    """The request's image count against the model's (GetInfo's max_images_per_prompt) and the
    gateway's own limit; the first image past either is the field named."""
    if not refs:
        return
    if model_max == 0:
        raise _refuse(
            f"messages[{refs[0].message}].content[{refs[0].part}]",
            "the model reads text only; image parts are not accepted",
        )
    most = model_max if limit is None else min(model_max, limit)
    if len(refs) > most:
        extra = refs[most]
        raise _refuse(
            f"messages[{extra.message}].content[{extra.part}]",
            f"the request has {len(refs)} images; at most {most} are accepted",
        )


def _base64_length(size: int) -> int:
    """Characters of the padded base64 encoding of ``size`` bytes."""
    return 4 * -(-size // 3)


def data_url_image(url: str, *, max_bytes: int, param: str) -> bytes:
    """The bytes of a base64 image data URL, refused before decoding when too large."""
    payload = url.partition(",")[2]
    if len(payload) > _base64_length(max_bytes):  # no need to decode what is already too long
        raise _refuse(param, f"the image is over {max_bytes} bytes")
    try:
        data = decode_data_url(url)
    except ImageError as exc:
        raise _refuse(param, str(exc)) from None
    if len(data) > max_bytes:
        raise _refuse(param, f"the image is over {max_bytes} bytes")
    return data


def remote_url(url: str, *, hosts: Sequence[str], param: str) -> str:
    """``url`` when it is http(s) on an allowed host; the refusal says what is accepted."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise _refuse(param, "must be a base64 data URL (data:image/png;base64,...)")
    if not hosts:
        raise _refuse(
            param,
            "remote image URLs are not accepted here; send the image as a base64 data URL "
            "(data:image/png;base64,...)",
        )
    if parts.hostname not in hosts:
        raise _refuse(param, f"images are not fetched from host {parts.hostname!r}")
    return url


async def fetch_image(url: str, *, max_bytes: int, timeout_s: float, param: str) -> bytes:
    """The body of a GET of ``url``: redirects are not followed (they could leave the allowed
    hosts), and the download stops as soon as it passes ``max_bytes``."""
    import httpx

    too_large = _refuse(param, f"the image is over {max_bytes} bytes")
    try:
        async with (
            asyncio.timeout(timeout_s),
            httpx.AsyncClient(follow_redirects=False, timeout=timeout_s) as client,
            client.stream("GET", url) as response,
        ):
            if response.status_code != 200:
                raise _refuse(param, f"fetching the image answered HTTP {response.status_code}")
            declared = response.headers.get("content-length", "")
            if declared.isdigit() and int(declared) > max_bytes:
                raise too_large
            chunks, size = [], 0
            async for chunk in response.aiter_bytes():
                size += len(chunk)
                if size > max_bytes:
                    raise too_large
                chunks.append(chunk)
    except TimeoutError:
        raise _refuse(param, f"the image was not fetched within {timeout_s:g} s") from None
    except httpx.HTTPError as exc:
        raise _refuse(param, f"the image could not be fetched ({type(exc).__name__})") from None
    return b"".join(chunks)


def check_image(data: bytes, *, param: str) -> None:
    """BadRequest unless ``data`` is an image file in ``FORMATS`` that decodes whole within
    the pixel limit (the header alone says little: a truncated file has a valid one)."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as image:
            kind = image.format
    except (UnidentifiedImageError, OSError, Image.DecompressionBombError):
        raise _refuse(param, "not a readable image") from None
    if kind not in FORMATS:
        raise _refuse(param, f"{kind} images are not accepted ({', '.join(sorted(FORMATS))})")
    try:
        open_image(data, name=param)
    except ImageError as exc:
        raise BadRequest(str(exc), param=param) from None


async def load_images(refs: Sequence[ImageRef], limits: Limits) -> list[bytes]:
    """The checked bytes of every image, in order. Decoding runs in a thread: a large image
    takes long enough to hold up every other request on the event loop."""
    images = []
    for ref in refs:
        if ref.url.startswith("data:"):
            data = data_url_image(ref.url, max_bytes=limits.max_image_bytes, param=ref.param)
        else:
            url = remote_url(ref.url, hosts=limits.image_url_hosts, param=ref.param)
            data = await fetch_image(
                url,
                max_bytes=limits.max_image_bytes,
                timeout_s=limits.image_fetch_timeout_s,
                param=ref.param,
            )
        await asyncio.to_thread(check_image, data, param=ref.param)
        images.append(data)
    return images
