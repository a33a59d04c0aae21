"""Images in chat requests: OpenAI ``image_url`` parts mapped to the sampler's content parts, and
every refusal naming its field (gateway/openai/images.py, serving_chat.message_content), over
fake replicas; tests/e2e/test_gateway_images.py asks a real vision model through vLLM."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import http.server
import io
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from PIL import Image

from gateway.errors import BadRequest, from_backend, sampler_param
from gateway.openai.images import (
    ImageRef,
    check_count,
    check_image,
    data_url_image,
    fetch_image,
    image_refs,
    remote_url,
)
from gateway.openai.protocol import ChatMessage
from gateway.openai.serving_chat import message_content
from gateway.settings import GatewaySettings, Limits
from rlfleet.sampler.v1 import sampler_pb2
from services.errors import InvalidArgument
from tests.unit.test_gateway_fakes import FakeReplica, ThreadedGateway

MODEL = "fake-model"
URL = "messages[0].content[{}].image_url.url"


def png(width: int = 8, height: int = 8, colour: str = "red", kind: str = "PNG") -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (width, height), colour).save(out, format=kind)
    return out.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def image_part(url: str, **extra: Any) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url, **extra}}


def text_part(text: str) -> dict[str, Any]:
    return {"type": "text", "text": text}


def user(*parts: dict[str, Any]) -> dict[str, Any]:
    return {"role": "user", "content": list(parts)}


@contextlib.contextmanager
def refused(param: str) -> Iterator[None]:
    """A BadRequest naming ``param``, in its ``param`` and at the start of its message."""
    with pytest.raises(BadRequest) as info:
        yield
    assert info.value.param == param, info.value.message
    assert info.value.message.startswith(param), info.value.message


# --------------------------------------------------------------------------- pure mapping


def messages(*raw: dict[str, Any]) -> list[ChatMessage]:
    return [ChatMessage.model_validate(m) for m in raw]


def test_image_refs_in_order_with_their_fields() -> None:
    refs = image_refs(
        messages(
            {"role": "system", "content": "look"},
            user(image_part("data:a"), text_part("and"), image_part("data:b", detail="low")),
            user(text_part("only text")),
            user(image_part("data:c")),
        )
    )
    assert refs == [ImageRef(1, 0, "data:a"), ImageRef(1, 2, "data:b"), ImageRef(3, 0, "data:c")]
    assert refs[1].param == "messages[1].content[2].image_url.url"


@pytest.mark.parametrize(
    ("message", "param"),
    [
        ({"role": "assistant", "content": [image_part("data:x")]}, "messages[0].content[0]"),
        (
            {"role": "system", "content": [text_part("a"), image_part("d")]},
            "messages[0].content[1]",
        ),
        (user(text_part("a"), {"type": "input_audio"}), "messages[0].content[1]"),
        (user({"type": "image_url"}), "messages[0].content[0]"),
        (user({"type": "text"}), "messages[0].content[0]"),
    ],
)
def test_image_refs_refuse_parts_out_of_place(message: dict[str, Any], param: str) -> None:
    with refused(param):
        image_refs(messages(message))


def test_message_content_keeps_parts_in_order() -> None:
    (message,) = messages(
        user(text_part("what"), image_part("u1"), text_part("is"), image_part("u2"))
    )
    content, parts = message_content(message, iter([b"one", b"two"]))
    assert content == ""
    assert [p.WhichOneof("part") for p in parts] == ["text", "image", "text", "image"]
    assert [p.text for p in parts[::2]] == ["what", "is"]
    assert [p.image.data for p in parts[1::2]] == [b"one", b"two"]
    # text-only content stays a string, as it was before images
    (message,) = messages(user(text_part("a"), text_part("b")))
    assert message_content(message, iter(())) == ("a\nb", [])
    (message,) = messages({"role": "user", "content": "plain"})
    assert message_content(message, iter(())) == ("plain", [])


def test_check_count() -> None:
    refs = [ImageRef(0, j, "data:") for j in range(3)]
    check_count([], model_max=0, limit=None)  # text needs nothing of the model
    check_count(refs, model_max=3, limit=None)
    with refused("messages[0].content[0]"):
        check_count(refs, model_max=0, limit=None)  # a text-only model
    with refused("messages[0].content[2]"):
        check_count(refs, model_max=2, limit=None)
    with refused("messages[0].content[1]"):
        check_count(refs, model_max=4, limit=1)  # the gateway's own limit, below the model's
    with refused("messages[0].content[0]"):
        check_count(refs, model_max=4, limit=0)


def test_data_url_image() -> None:
    data = png()
    param = URL.format(0)
    assert data_url_image(data_url(data), max_bytes=1 << 20, param=param) == data
    assert data_url_image(data_url(data, "image/jpeg"), max_bytes=len(data), param=param) == data
    with refused(param):
        data_url_image(data_url(data), max_bytes=len(data) - 1, param=param)
    with refused(param):  # refused by its length, before decoding
        data_url_image("data:image/png;base64," + "A" * 8000, max_bytes=1024, param=param)
    for bad in ("data:image/png;base64,%%%", "data:text/plain;base64,QQ==", "data:image/png,x"):
        with refused(param):
            data_url_image(bad, max_bytes=1 << 20, param=param)


def test_remote_url_needs_an_allowed_host() -> None:
    param = URL.format(1)
    with refused(param):
        remote_url("https://example.com/a.png", hosts=[], param=param)
    with refused(param):
        remote_url("https://evil.example/a.png", hosts=["example.com"], param=param)
    with refused(param):
        remote_url("file:///etc/passwd", hosts=["example.com"], param=param)
    with refused(param):
        remote_url("x", hosts=["example.com"], param=param)
    url = "https://example.com:8443/a.png"
    assert remote_url(url, hosts=["example.com"], param=param) == url


def test_check_image() -> None:
    param = URL.format(0)
    check_image(png(), param=param)
    check_image(png(kind="JPEG"), param=param)
    with refused(param):
        check_image(b"not an image at all", param=param)
    with refused(param):  # a valid header, the pixels cut off
        check_image(png(64, 64, "blue")[:80], param=param)
    with refused(param):  # a format the samplers do not take
        check_image(png(kind="TIFF"), param=param)
    with refused(param):  # a small file of too many pixels
        check_image(png(5000, 4000), param=param)


def test_sampler_fields_of_parts_name_the_content_part() -> None:
    field = "prompt.chat.messages[2].parts[1].image"
    assert sampler_param(field, prompt_param="messages") == "messages[2].content[1]"
    assert sampler_param("prompt.chat.messages[2]", prompt_param="messages") == "messages[2]"
    assert sampler_param("prompt.chat", prompt_param="messages") == "messages"
    error = from_backend(
        InvalidArgument(f"sampler s:1: GenerateStream: {field}: not a readable image", field=field),
        prompt_param="messages",
        top_logprobs="top_logprobs",
    )
    assert error.param == "messages[2].content[1]" and error.message == "not a readable image"


def test_limits_settings() -> None:
    limits = Limits()
    assert limits.max_images is None and limits.image_url_hosts == []
    assert limits.max_image_bytes <= 16 << 20
    with pytest.raises(ValueError):
        Limits(max_image_bytes=64 << 20)


# --------------------------------------------------------------------------- remote fetch


class _Images(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        if self.path == "/moved.png":
            self.send_response(302)
            self.send_header("Location", "/a.png")
            self.end_headers()
            return
        if self.path != "/a.png":
            self.send_error(404)
            return
        body = png(16, 16)
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def image_host() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Images)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_fetch_image(image_host: str) -> None:
    param = URL.format(0)

    def fetch(path: str, max_bytes: int = 1 << 20) -> bytes:
        return asyncio.run(
            fetch_image(image_host + path, max_bytes=max_bytes, timeout_s=5.0, param=param)
        )

    assert fetch("/a.png") == png(16, 16)
    with refused(param):
        fetch("/a.png", max_bytes=50)
    with refused(param):  # redirects could leave the allowed hosts
        fetch("/moved.png")
    with refused(param):
        fetch("/missing.png")


# --------------------------------------------------------------------------- over HTTP


class VisionReplica(FakeReplica):
    """A fake replica of a model that reads up to two images per prompt."""

    async def info(self) -> sampler_pb2.GetInfoResponse:
        info = await super().info()
        info.max_images_per_prompt = 2
        return info


def gateway_settings(**limits: Any) -> GatewaySettings:
    return GatewaySettings.model_validate(
        {"samplers": ["a:1"], "health_interval_s": 0.05, "http_port": 0, "limits": limits}
    )


@pytest.fixture(scope="module")
def replica() -> VisionReplica:
    return VisionReplica("fake:1")


@pytest.fixture(scope="module")
def gw(replica: VisionReplica, image_host: str) -> Iterator[ThreadedGateway]:
    g = ThreadedGateway(gateway_settings(image_url_hosts=["127.0.0.1"]), [replica])
    yield g
    g.close()


@pytest.fixture
def client(gw: ThreadedGateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key="none", max_retries=0)


def sent_parts(replica: VisionReplica) -> list[tuple[str, Any]]:
    (message,) = replica.requests[-1].prompt.chat.messages
    assert message.content == ""
    return [
        (p.WhichOneof("part"), p.text if p.WhichOneof("part") == "text" else p.image.data)
        for p in message.parts
    ]


def test_chat_with_images(client: openai.OpenAI, replica: VisionReplica) -> None:
    red, blue = png(colour="red"), png(colour="blue")
    content = [
        text_part("which is red?"),
        image_part(data_url(red), detail="high"),
        image_part(data_url(blue, "image/webp")),  # the MIME type is the client's word only
    ]
    out = client.chat.completions.create(
        model=MODEL, messages=[user(*content)], max_completion_tokens=3
    )
    assert out.choices[0].message.content == "abc"
    assert sent_parts(replica) == [("text", "which is red?"), ("image", red), ("image", blue)]


def test_chat_stream_with_images(client: openai.OpenAI, replica: VisionReplica) -> None:
    red = png()
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=[user(image_part(data_url(red)), text_part("colour?"))],
            max_completion_tokens=3,
            stream=True,
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "abc"
    assert chunks[-1].choices[0].finish_reason == "length"
    assert sent_parts(replica) == [("image", red), ("text", "colour?")]


def test_chat_with_an_allowed_remote_image(
    client: openai.OpenAI, replica: VisionReplica, image_host: str
) -> None:
    client.chat.completions.create(
        model=MODEL, messages=[user(image_part(image_host + "/a.png"))], max_completion_tokens=1
    )
    assert sent_parts(replica) == [("image", png(16, 16))]


def chat_error(gw: ThreadedGateway, *msgs: dict[str, Any]) -> dict[str, Any]:
    response = httpx.post(
        gw.url + "/v1/chat/completions", json={"model": MODEL, "messages": list(msgs)}
    )
    assert response.status_code == 400, response.text
    error: dict[str, Any] = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    return error


def test_image_refusals_name_the_field(
    gw: ThreadedGateway, replica: VisionReplica, image_host: str
) -> None:
    before = len(replica.requests)
    ok = data_url(png())
    cases = [
        (user(text_part("x"), image_part("https://example.com/a.png")), URL.format(1)),
        (user(image_part(image_host.replace("127.0.0.1", "localhost") + "/a.png")), URL.format(0)),
        (user(image_part(ok), image_part(ok), image_part(ok)), "messages[0].content[2]"),
        (user(image_part(data_url(b"garbage"))), URL.format(0)),
        (user(image_part("data:image/png;base64,@@")), URL.format(0)),
        (user(image_part(data_url(png(kind="TIFF"), "image/tiff"))), URL.format(0)),
        (user(image_part(ok, detail="ultra")), "messages[0].content[0].image_url.detail"),
        (user({"type": "image_url", "image_url": ok}), "messages[0].content[0].image_url"),
        ({"role": "assistant", "content": [image_part(ok)]}, "messages[0].content[0]"),
    ]
    for message, param in cases:
        assert chat_error(gw, message)["param"] == param, message
    assert len(replica.requests) == before  # no sampler saw any of them


def test_image_size_and_count_limits(replica: VisionReplica) -> None:
    g = ThreadedGateway(gateway_settings(max_images=1, max_image_bytes=1024), [replica])
    try:
        big = data_url(png(64, 64, kind="BMP"))  # an uncompressed file over the limit
        assert chat_error(g, user(image_part(big)))["param"] == URL.format(0)
        ok = data_url(png())
        error = chat_error(g, user(image_part(ok), image_part(ok)))
        assert error["param"] == "messages[0].content[1]" and "at most 1" in error["message"]
    finally:
        g.close()


def test_images_to_a_text_only_model_are_refused() -> None:
    g = ThreadedGateway(gateway_settings(), [FakeReplica("fake:3")])
    try:
        error = chat_error(g, user(text_part("x"), image_part(data_url(png()))))
        assert error["param"] == "messages[0].content[1]" and "text only" in error["message"]
    finally:
        g.close()
