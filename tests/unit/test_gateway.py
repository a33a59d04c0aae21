"""The gateway's HTTP surface (OpenAI protocol, SSE, errors, limits, balancing, failover) over
fake replicas; tests/contract/test_gateway.py runs the same client paths against real samplers."""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import Iterator

import httpx
import openai
import prometheus_client
import pytest

from gateway.limits import KeyLimiter, TokenBucket
from gateway.settings import ApiKey, GatewaySettings, Limits
from services.errors import InvalidArgument, ResourceExhausted, Unavailable
from tests.unit.test_gateway_fakes import FakeReplica, ThreadedGateway

MODEL = "fake-model"


def settings(**kw: object) -> GatewaySettings:
    base: dict[str, object] = {
        "samplers": ["a:1", "b:2"],
        "health_interval_s": 0.05,
        "http_port": 0,
    }
    return GatewaySettings.model_validate({**base, **kw})


@pytest.fixture(scope="module")
def replicas() -> list[FakeReplica]:
    return [FakeReplica("fake:1"), FakeReplica("fake:2")]


@pytest.fixture(scope="module")
def gw(replicas: list[FakeReplica]) -> Iterator[ThreadedGateway]:
    g = ThreadedGateway(settings(limits={"max_body_bytes": 4096, "max_prompts": 4}), replicas)
    yield g
    g.close()


@pytest.fixture(autouse=True)
def _reset(replicas: list[FakeReplica]) -> Iterator[None]:
    yield
    for r in replicas:
        r.serving, r.fail_before, r.fail_after_tokens, r.delay_s = True, None, None, 0.0


@pytest.fixture
def client(gw: ThreadedGateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key="none", max_retries=0)


def test_models(client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL


def test_completion_n_and_usage(client: openai.OpenAI) -> None:
    out = client.completions.create(model=MODEL, prompt="hi", max_tokens=3, n=2)
    assert [c.index for c in out.choices] == [0, 1]
    assert [c.text for c in out.choices] == ["abc", "bcd"]
    assert all(c.finish_reason == "length" for c in out.choices)
    assert out.usage.prompt_tokens == 2 and out.usage.completion_tokens == 6
    assert out.usage.total_tokens == 8 and out.object == "text_completion"


def test_completion_prompt_list_fans_out(
    client: openai.OpenAI, replicas: list[FakeReplica]
) -> None:
    before = [len(r.requests) for r in replicas]
    out = client.completions.create(model=MODEL, prompt=["a", "bb", "ccc"], max_tokens=2, n=2)
    assert len(out.choices) == 6 and [c.index for c in out.choices] == list(range(6))
    assert out.usage.prompt_tokens == 1 + 2 + 3
    assert sum(len(r.requests) for r in replicas) - sum(before) == 3
    assert all(len(r.requests) > b for r, b in zip(replicas, before, strict=True))  # balanced
    out = client.completions.create(model=MODEL, prompt=[[5, 6], [7]], max_tokens=1)
    assert len(out.choices) == 2 and out.usage.prompt_tokens == 3
    out = client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=1)
    assert len(out.choices) == 1 and out.usage.prompt_tokens == 3


def test_completion_logprobs_and_echo(client: openai.OpenAI) -> None:
    out = client.completions.create(model=MODEL, prompt="x", max_tokens=3, logprobs=2)
    lp = out.choices[0].logprobs
    assert lp.tokens == ["a", "b", "c"]
    assert lp.token_logprobs == pytest.approx([-0.5, -0.6, -0.7])
    assert lp.text_offset == [0, 1, 2]
    assert set(lp.top_logprobs[0]) == {"a", "b"}
    out = client.completions.create(model=MODEL, prompt="Q:", max_tokens=2, echo=True)
    assert out.choices[0].text == "Q:ab"


def test_completion_stop(client: openai.OpenAI) -> None:
    out = client.completions.create(model=MODEL, prompt="x", max_tokens=10, stop=["cd"])
    assert out.choices[0].finish_reason == "stop"


def test_completion_stream(client: openai.OpenAI) -> None:
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=["x", "y"],
            max_tokens=3,
            n=2,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text: dict[int, str] = {}
    finish = {}
    for chunk in chunks[:-1]:
        assert chunk.usage is None
        for c in chunk.choices:
            text[c.index] = text.get(c.index, "") + c.text
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert text == {0: "abc", 1: "bcd", 2: "abc", 3: "bcd"}
    assert finish == dict.fromkeys(range(4), "length")
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12


def test_chat(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_completion_tokens=4,
        n=2,
        logprobs=True,
        top_logprobs=3,
    )
    assert out.object == "chat.completion"
    assert [c.message.content for c in out.choices] == ["abcd", "bcde"]
    assert out.choices[0].message.role == "assistant"
    content = out.choices[0].logprobs.content
    assert [t.token for t in content] == ["a", "b", "c", "d"]
    assert len(content[0].top_logprobs) == 3 and content[0].bytes == [97]
    assert out.usage.completion_tokens == 8


def test_chat_stream(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "system", "content": "s"},
            {"role": "user", "content": [{"type": "text", "text": "hi"}]},
        ],
        max_tokens=3,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "abc"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and finishes.count("length") == 1
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 3


def test_the_sampler_streams_token_by_token_only_to_streaming_clients(
    client: openai.OpenAI, replicas: list[FakeReplica]
) -> None:
    def asked(**kw: object) -> list[int]:
        for r in replicas:
            r.requests.clear()
        chat = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3, **kw
        )
        text = client.completions.create(model=MODEL, prompt="hi", max_tokens=3, **kw)
        if kw.get("stream"):
            list(chat), list(text)  # type: ignore[call-overload]
        return [q.stream_interval for r in replicas for q in r.requests]

    # Not streamed: the first token, then the rest at once (no completion is that long).
    assert [i > 2**30 for i in asked()] == [True, True]
    assert asked(stream=True) == [0, 0]  # streamed: every token as it comes


async def test_async_client_stream(gw: ThreadedGateway) -> None:
    client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="none", max_retries=0)
    stream = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2, stream=True
    )
    text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    assert text == "ab"
    await client.close()


def test_raw_sse_format(gw: ThreadedGateway) -> None:
    with httpx.stream(
        "POST",
        gw.url + "/v1/completions",
        json={"model": MODEL, "prompt": "x", "max_tokens": 2, "stream": True},
    ) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    first = json.loads(lines[0].removeprefix("data: "))
    assert first["object"] == "text_completion" and first["choices"][0]["text"] == "a"


def test_http_connections_have_nagle_off(gw: ThreadedGateway) -> None:
    """Each accepted connection has TCP_NODELAY: with Nagle on, the first SSE chunk waited for
    the client's delayed ACK of the headers (~40 ms of TTFT, seen in bench/serving/gateway.py)."""
    import socket

    async def nodelay() -> list[int]:
        connections = gw.http.server.server_state.connections
        return [
            c.transport.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
            for c in connections
        ]

    with httpx.Client() as http:  # keep-alive: the connection stays open while checked
        assert http.get(gw.url + "/health").status_code == 200
        flags = gw.call(nodelay())
    assert flags and all(flags), flags


# --------------------------------------------------------------------------- errors


def error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def test_bad_requests(gw: ThreadedGateway) -> None:
    url = gw.url + "/v1/completions"
    e = error(httpx.post(url, json={"model": MODEL, "prompt": "x", "temperature": 3}), 400)
    assert e["param"] == "temperature"
    e = error(httpx.post(url, json={"model": MODEL}), 400)
    assert e["param"] == "prompt"
    e = error(httpx.post(url, json={"model": MODEL, "prompt": "x", "suffix": "y"}), 400)
    assert e["param"] == "suffix"
    e = error(httpx.post(url, json={"model": MODEL, "prompt": "x", "logit_bias": {"1": 2}}), 400)
    assert e["param"] == "logit_bias"
    e = error(
        httpx.post(url, content=b"{not json", headers={"content-type": "application/json"}), 400
    )
    e = error(httpx.post(url, json={"model": MODEL, "prompt": ["x"] * 5}), 400)
    assert e["param"] == "prompt"
    # the sampler's INVALID_ARGUMENT names the OpenAI field
    e = error(httpx.post(url, json={"model": MODEL, "prompt": "x", "n": 12}), 400)
    assert e["param"] == "n" and "fake:" not in e["message"]
    e = error(httpx.post(url, json={"model": MODEL, "prompt": "x" * 80}), 400)
    assert e["param"] == "prompt"
    chat = gw.url + "/v1/chat/completions"
    e = error(
        httpx.post(
            chat,
            json={
                "model": MODEL,
                "messages": [
                    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
                ],
            },
        ),
        400,
    )
    assert e["param"] == "messages[0].content[0]"
    e = error(httpx.post(chat, json={"model": MODEL, "messages": [{"content": "x"}]}), 400)
    assert e["param"] == "messages[0].role"
    e = error(
        httpx.post(
            chat,
            json={
                "model": MODEL,
                "messages": [{"role": "user", "content": "x"}],
                "tools": [{"type": "function", "function": {"description": "no name"}}],
            },
        ),
        400,
    )
    assert e["param"] == "tools[0].function.name"
    # unknown fields are ignored, as vLLM does
    ok = httpx.post(url, json={"model": MODEL, "prompt": "x", "max_tokens": 1, "whatever": 1})
    assert ok.status_code == 200


def test_context_length_is_checked(gw: ThreadedGateway) -> None:
    e = error(
        httpx.post(
            gw.url + "/v1/completions", json={"model": MODEL, "prompt": "x" * 10, "max_tokens": 60}
        ),
        400,
    )
    assert e["code"] == "context_length_exceeded"


def test_unknown_model_404(gw: ThreadedGateway) -> None:
    e = error(httpx.post(gw.url + "/v1/completions", json={"model": "nope", "prompt": "x"}), 404)
    assert e["code"] == "model_not_found" and e["param"] == "model"
    with pytest.raises(openai.NotFoundError):
        openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0).chat.completions.create(
            model="nope", messages=[{"role": "user", "content": "x"}]
        )


def test_body_too_large_413(gw: ThreadedGateway) -> None:
    e = error(
        httpx.post(gw.url + "/v1/completions", json={"model": MODEL, "prompt": "x" * 5000}), 413
    )
    assert e["code"] == "body_too_large"

    def chunks() -> Iterator[bytes]:
        yield b'{"model": "fake-model", "prompt": "'
        for _ in range(10):
            yield b"x" * 1000
        yield b'"}'

    error(httpx.post(gw.url + "/v1/completions", content=chunks()), 413)


def test_unknown_route_is_an_openai_error(gw: ThreadedGateway) -> None:
    error(httpx.get(gw.url + "/v1/nothing"), 404)


def test_sampler_overloaded_is_429_after_trying_all(
    gw: ThreadedGateway, replicas: list[FakeReplica]
) -> None:
    for r in replicas:
        r.fail_before = lambda: ResourceExhausted("sampler x: GenerateStream: queue full")
    r = httpx.post(gw.url + "/v1/completions", json={"model": MODEL, "prompt": "x"})
    error(r, 429)
    assert r.headers["retry-after"] == "1"


def test_invalid_argument_is_not_retried(gw: ThreadedGateway, replicas: list[FakeReplica]) -> None:
    for r in replicas:
        r.fail_before = lambda: InvalidArgument(
            "sampler x: GenerateStream: sampling.top_p: bad", field="sampling.top_p"
        )
    before = sum(len(r.requests) for r in replicas)
    e = error(httpx.post(gw.url + "/v1/completions", json={"model": MODEL, "prompt": "x"}), 400)
    assert e["param"] == "top_p"
    assert sum(len(r.requests) for r in replicas) == before + 1


# --------------------------------------------------------------------------- backends


def test_failover_before_first_delta(gw: ThreadedGateway, replicas: list[FakeReplica]) -> None:
    replicas[0].fail_before = lambda: Unavailable("sampler fake:1: GenerateStream: refused")
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
    for _ in range(4):
        out = client.completions.create(model=MODEL, prompt="x", max_tokens=2)
        assert out.choices[0].text == "ab"
    # the failing one was taken out of rotation until its health check passes
    replicas[0].serving = False
    gw.call(_wait(lambda: not gw.gateway.pool.backends[0].healthy))
    before = len(replicas[0].requests)
    for _ in range(3):
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=1, stream=True
        )
    assert len(replicas[0].requests) == before
    replicas[0].serving, replicas[0].fail_before = True, None
    gw.call(_wait(lambda: gw.gateway.pool.backends[0].healthy))


def test_non_stream_rerun_when_lost_midway(
    gw: ThreadedGateway, replicas: list[FakeReplica]
) -> None:
    for r in replicas:
        r.fail_after_tokens = 2
    first = replicas[0]
    r = httpx.post(
        gw.url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 4}
    )
    error(r, 503)  # every replica lost it: 503, never a 500
    for r in replicas:
        r.fail_after_tokens = None
    first.fail_after_tokens = 2
    gw.call(_wait(lambda: all(b.healthy for b in gw.gateway.pool.backends)))
    for _ in range(3):
        r = httpx.post(
            gw.url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 4}
        )
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "abcd"
        gw.call(_wait(lambda: all(b.healthy for b in gw.gateway.pool.backends)))


def test_stream_lost_midway_ends_with_an_error_event(
    gw: ThreadedGateway, replicas: list[FakeReplica]
) -> None:
    for r in replicas:
        r.fail_after_tokens = 2
    with httpx.stream(
        "POST",
        gw.url + "/v1/completions",
        json={"model": MODEL, "prompt": "x", "max_tokens": 5, "stream": True},
    ) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    assert "error" in json.loads(lines[-2].removeprefix("data: "))
    for r in replicas:
        r.fail_after_tokens = None
    gw.call(_wait(lambda: all(b.healthy for b in gw.gateway.pool.backends)))


def test_stream_error_event_names_no_internal_address(
    gw: ThreadedGateway, replicas: list[FakeReplica], caplog: pytest.LogCaptureFixture
) -> None:
    for r in replicas:
        r.fail_after_tokens = 2
    bodies = [
        ("/v1/completions", {"prompt": "x"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
    ]
    for path, body in bodies:
        with httpx.stream(
            "POST",
            gw.url + path,
            json={"model": MODEL, "max_tokens": 5, "stream": True, **body},
        ) as r:
            lines = [line for line in r.iter_lines() if line]
        assert lines[-1] == "data: [DONE]"
        event = lines[-2]
        e = json.loads(event.removeprefix("data: "))["error"]
        assert set(e) == {"message", "type", "param", "code"}
        assert e["type"] == "service_unavailable" and e["code"] == "backend_unavailable"
        for internal in ("fake:", "127.0.0.1", "41234", "UNAVAILABLE", "GenerateStream"):
            assert internal not in event, (internal, event)
    # ... and the non-streaming request that every replica lost (a 503)
    r = httpx.post(
        gw.url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 5}
    )
    assert r.status_code == 503 and "127.0.0.1" not in r.text and "fake:" not in r.text
    # the detail is in the gateway's log instead
    assert any("127.0.0.1:41234" in rec.getMessage() for rec in caplog.records)
    for r in replicas:
        r.fail_after_tokens = None
    gw.call(_wait(lambda: all(b.healthy for b in gw.gateway.pool.backends)))


def test_prompt_too_long_for_the_model_is_context_length_exceeded(gw: ThreadedGateway) -> None:
    e = error(
        httpx.post(
            gw.url + "/v1/completions", json={"model": MODEL, "prompt": "x" * 70, "max_tokens": 1}
        ),
        400,
    )
    assert e["code"] == "context_length_exceeded" and e["param"] == "prompt"
    assert e["message"].startswith(
        "This model's maximum context length is 64 tokens. However, your prompt resulted in 70 "
        "tokens"
    )
    messages = [{"role": "user", "content": "x" * 70}]
    e = error(
        httpx.post(gw.url + "/v1/chat/completions", json={"model": MODEL, "messages": messages}),
        400,
    )
    assert e["code"] == "context_length_exceeded" and e["param"] == "messages"
    assert e["message"].startswith("This model's maximum context length is 64 tokens. However, ")
    assert "your messages resulted in 76 tokens" in e["message"]  # "<user>" and the 70
    assert "prompt." not in e["message"] and "fake:" not in e["message"]


def test_no_healthy_backend_503(gw: ThreadedGateway, replicas: list[FakeReplica]) -> None:
    for r in replicas:
        r.serving = False
    gw.call(_wait(lambda: not gw.gateway.pool.healthy_backends()))
    r = httpx.post(gw.url + "/v1/completions", json={"model": MODEL, "prompt": "x"})
    assert error(r, 503)["code"] == "no_healthy_backend"
    assert httpx.get(gw.url + "/health").status_code == 503
    for r in replicas:
        r.serving = True
    gw.call(_wait(lambda: len(gw.gateway.pool.healthy_backends()) == 2))
    assert httpx.get(gw.url + "/health").json()["status"] == "ok"


def test_client_disconnect_cancels_the_stream(
    gw: ThreadedGateway, replicas: list[FakeReplica]
) -> None:
    for r in replicas:
        r.delay_s = 0.05
    cancelled = sum(r.cancelled for r in replicas)
    with httpx.stream(
        "POST",
        gw.url + "/v1/completions",
        json={"model": MODEL, "prompt": "x", "max_tokens": 50, "stream": True},
    ) as r:
        next(r.iter_lines())
    gw.call(_wait(lambda: sum(r.cancelled for r in replicas) == cancelled + 1, 5))
    assert all(r.open_streams == 0 for r in replicas)
    gw.call(_wait(lambda: all(b.outstanding == 0 for b in gw.gateway.pool.backends), 5))


def test_metrics(gw: ThreadedGateway) -> None:
    httpx.post(gw.url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1})
    text = httpx.get(gw.url + "/metrics").text
    assert 'rlfleet_gateway_requests_total{route="/v1/completions",status="200"}' in text
    for name in (
        "gateway_ttft_seconds_bucket",
        "gateway_request_seconds_bucket",
        "gateway_completion_tokens_total",
        "gateway_prompt_tokens_total",
        'gateway_backend_outstanding{backend="fake:1"}',
        "gateway_backend_errors_total",
    ):
        assert "rlfleet_" + name in text, name


def sample(name: str, **labels: str) -> float:
    return prometheus_client.REGISTRY.get_sample_value(name, labels) or 0.0


def stream_body(path: str, max_tokens: int) -> dict[str, object]:
    if path == "/v1/completions":
        return {"model": MODEL, "prompt": "x", "max_tokens": max_tokens, "stream": True}
    messages = [{"role": "user", "content": "x"}]
    return {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "stream": True}


def has_tokens(line: str) -> bool:
    if not line.startswith("data: {"):
        return False
    choice = json.loads(line.removeprefix("data: "))["choices"][0]
    return bool(choice.get("text") or choice.get("delta", {}).get("content"))


async def test_in_flight_counts_streams_until_their_last_byte(
    gw: ThreadedGateway, replicas: list[FakeReplica]
) -> None:
    import contextlib

    for r in replicas:
        r.delay_s = 0.05
    gauge = "rlfleet_gateway_in_flight_requests"
    base = sample(gauge)
    paths = ["/v1/completions", "/v1/chat/completions"] * 2
    async with (
        httpx.AsyncClient(base_url=gw.url, timeout=30) as client,
        contextlib.AsyncExitStack() as stack,
    ):
        streams = []
        for path in paths:
            r = await stack.enter_async_context(
                client.stream("POST", path, json=stream_body(path, 30))
            )
            lines = r.aiter_lines()
            while not has_tokens(await anext(lines)):  # streaming has begun
                pass
            streams.append((r, lines))
        assert sample(gauge) == base + 4  # every open stream, past its first token
        await streams[0][0].aclose()  # a client that goes away is no longer in flight
        await asyncio.to_thread(gw.call, _wait(lambda: sample(gauge) == base + 3))
        for _, lines in streams[1:]:
            assert [line async for line in lines if line][-1] == "data: [DONE]"
    await asyncio.to_thread(gw.call, _wait(lambda: sample(gauge) == base))


def test_ttft_is_taken_when_the_first_token_chunk_is_sent(monkeypatch: pytest.MonkeyPatch) -> None:
    import time

    from tests.unit import test_gateway_fakes

    delay = 0.2

    def slow_sends(app):  # type: ignore[no-untyped-def]
        """Each body chunk takes ``delay`` to reach the socket (a slow client or network)."""

        async def wrapped(scope, receive, send):  # type: ignore[no-untyped-def]
            async def late(message):  # type: ignore[no-untyped-def]
                if message["type"] == "http.response.body" and message.get("body"):
                    await asyncio.sleep(delay)
                await send(message)

            await app(scope, receive, late)

        return wrapped

    build = test_gateway_fakes.build_app
    monkeypatch.setattr(test_gateway_fakes, "build_app", lambda g: slow_sends(build(g)))
    g = ThreadedGateway(settings(), [FakeReplica("slow:1")])
    try:
        path = "/v1/chat/completions"
        ttft = "rlfleet_gen_ai_server_time_to_first_token_seconds"
        labels = {"route": path, "stream": "true"}
        count, total = sample(ttft + "_count", **labels), sample(ttft + "_sum", **labels)
        old_total = sample("rlfleet_gateway_ttft_seconds_sum", route=path)
        began = time.monotonic()
        with httpx.stream("POST", g.url + path, json=stream_body(path, 3)) as r:
            lines = r.iter_lines()
            while not has_tokens(next(lines)):  # the role chunk comes first
                pass
            seen = time.monotonic() - began
            list(lines)
        # The old name (kept) reports the same observation.
        assert sample("rlfleet_gateway_ttft_seconds_sum", route=path) - old_total >= 2 * delay
        assert sample(ttft + "_count", **labels) == count + 1
        measured = sample(ttft + "_sum", **labels) - total
        # The role chunk and the first content chunk were both sent before it was taken ...
        assert measured >= 2 * delay
        # ... and it is no later than the client saw that chunk.
        assert measured <= seen + 0.1
    finally:
        g.close()


def bucket_bounds(name: str) -> list[float]:
    for family in prometheus_client.REGISTRY.collect():
        if family.name == name:
            bounds = {float(s.labels["le"]) for s in family.samples if s.name.endswith("_bucket")}
            return sorted(b for b in bounds if b != float("inf"))
    raise AssertionError(f"no metric {name}")


def test_genai_histograms_have_fine_buckets(gw: ThreadedGateway) -> None:
    path = "/v1/completions"
    with httpx.stream("POST", gw.url + path, json=stream_body(path, 5)) as r:
        list(r.iter_lines())
    httpx.post(gw.url + path, json={"model": MODEL, "prompt": "x", "max_tokens": 5})
    text = httpx.get(gw.url + "/metrics").text
    for name in (
        "gen_ai_server_time_to_first_token_seconds",
        "gen_ai_server_time_per_output_token_seconds",
        "gen_ai_server_request_duration_seconds",
        "gen_ai_client_token_usage",
        "gateway_request_queue_seconds",
    ):
        for stream in ("true", "false"):
            if "queue" in name or "token_usage" in name:
                continue
            assert f'rlfleet_{name}_bucket{{le="0.01",route="{path}",stream="{stream}"' in text or (
                f'rlfleet_{name}_bucket{{error_type="",le="0.01",route="{path}",stream="{stream}"'
                in text
            ), (name, stream)
        assert f"rlfleet_{name}_count" in text, name
    # The OpenTelemetry GenAI advisory boundaries are all there (so the histograms aggregate
    # down to them), with more between 0.1 s and 5 s where percentiles are read.
    otel_ttft = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75]
    otel_ttft += [1, 2.5, 5, 7.5, 10]
    otel_tpot = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1, 2.5]
    otel_duration = [0.01 * 2**k for k in range(14)]
    otel_tokens = [4**k for k in range(14)]
    for name, otel in (
        ("rlfleet_gen_ai_server_time_to_first_token_seconds", otel_ttft),
        ("rlfleet_gen_ai_server_time_per_output_token_seconds", otel_tpot),
        ("rlfleet_gen_ai_server_request_duration_seconds", otel_duration),
        ("rlfleet_gen_ai_client_token_usage", otel_tokens),
    ):
        bounds = bucket_bounds(name)
        assert all(any(abs(b - o) < 1e-9 for b in bounds) for o in otel), name
    ttft = bucket_bounds("rlfleet_gen_ai_server_time_to_first_token_seconds")
    assert len([b for b in ttft if 1.0 < b < 2.5]) >= 3  # 1.2 s is read within 25%, not 2.4 s
    duration = bucket_bounds("rlfleet_gen_ai_server_request_duration_seconds")
    assert all(hi / lo <= 1.5 + 1e-9 for lo, hi in itertools.pairwise(duration))
    tokens = "rlfleet_gen_ai_client_token_usage_count"
    assert sample(tokens, route=path, token_type="output") >= 2


async def _wait(predicate, timeout_s: float = 5.0) -> None:  # type: ignore[no-untyped-def]
    import asyncio

    async with asyncio.timeout(timeout_s):
        while not predicate():
            await asyncio.sleep(0.01)


# --------------------------------------------------------------------------- auth and limits


def test_api_keys_and_rate_limits(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GW_TEST_KEY", "secret-2")
    s = settings(api_keys=[{"key": "secret-1", "rpm": 2}, {"key_env": "GW_TEST_KEY", "tpm": 5}])
    g = ThreadedGateway(s, [FakeReplica()])
    try:
        url = g.url + "/v1/completions"
        body = {"model": MODEL, "prompt": "x", "max_tokens": 2}
        assert error(httpx.post(url, json=body), 401)["code"] == "missing_api_key"
        bad = {"Authorization": "Bearer nope"}
        assert error(httpx.post(url, json=body, headers=bad), 401)["code"] == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=g.url + "/v1", api_key="nope", max_retries=0).models.list()
        one = {"Authorization": "Bearer secret-1"}
        assert httpx.post(url, json=body, headers=one).status_code == 200
        assert httpx.post(url, json=body, headers=one).status_code == 200
        r = httpx.post(url, json=body, headers=one)
        assert error(r, 429)["type"] == "requests" and int(r.headers["retry-after"]) >= 1
        two = {"Authorization": "Bearer secret-2"}
        assert httpx.post(url, json=body, headers=two).status_code == 200  # 1 + 2 tokens
        assert httpx.post(url, json=body, headers=two).status_code == 200  # 6 of 5: in debt
        r = httpx.post(url, json=body, headers=two)
        assert error(r, 429)["type"] == "tokens"
        with pytest.raises(openai.RateLimitError):
            openai.OpenAI(
                base_url=g.url + "/v1", api_key="secret-2", max_retries=0
            ).completions.create(**body)
        assert httpx.get(g.url + "/health").status_code == 200  # no key needed
    finally:
        g.close()


def test_token_bucket() -> None:
    now = [0.0]
    bucket = TokenBucket.per_minute(60, clock=lambda: now[0])
    assert bucket.try_take(60) == 0
    assert bucket.try_take(1) == pytest.approx(1.0)
    now[0] = 2.0
    assert bucket.try_take(2) == 0
    limiter = KeyLimiter("k", tpm=60, clock=lambda: now[0])
    limiter.charge_tokens(120)
    assert limiter.admit() == ("tokens", pytest.approx(61.0))


def test_settings_validation() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        ApiKey(key="a", key_env="B")
    with pytest.raises(ValueError):
        GatewaySettings(samplers=[])
    assert Limits().max_body_bytes == 4 << 20
    assert GatewaySettings(samplers=["s"]).http_port == 8000


def test_serve_job_expands() -> None:
    from gateway.jobs import SERVE_JOB, ServeJobSettings

    s = ServeJobSettings(
        model="exports/grpo-arith-w4a16",
        replicas=2,
        port=9000,
        api_keys=[{"key_env": "K", "rpm": 10}],
        max_model_len=256,
    )
    entries = SERVE_JOB.expand(s, "demo")
    assert [e["name"] for e in entries] == ["sampler-0", "sampler-1", "gateway"]
    assert entries[-1]["main"] and entries[-1]["settings"]["samplers"] == ["sampler-0", "sampler-1"]
    assert entries[0]["settings"]["served_model_name"] == "grpo-arith-w4a16"
    assert "weights_from" not in entries[0]["settings"]
    from gateway.settings import GatewaySettings as G
    from sampler.lm.settings import SamplerSettings

    SamplerSettings.model_validate(entries[0]["settings"])
    G.model_validate(entries[-1]["settings"])


def test_examples_serve_yaml_validates() -> None:
    from pathlib import Path

    from services.config import load_run_config

    config = load_run_config(Path(__file__).parents[2] / "examples" / "serve.yaml")
    assert [s.name for s in config.services] == ["sampler-0", "sampler-1", "gateway"]
