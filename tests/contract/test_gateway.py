"""The gateway against real vLLM samplers (`rlfleet serve sampler`, two replicas), called with the
official `openai` client (sync and async, streaming, chat and completions, n > 1, logprobs) and
httpx for raw status and header checks; the last test kills a replica mid-run.

One pair of sampler processes for the whole module (vLLM takes 15-60 s to start here).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from clients.sampler import SERVICE_NAME
from gateway.settings import GatewaySettings
from services.ports import free_port
from services.server import wait_for_health
from tests.unit.test_gateway_fakes import ThreadedGateway

pytestmark = pytest.mark.slow  # two vLLM engines

REPO = Path(__file__).resolve().parents[2]
MODEL = "tiny"
PROMPT = "Q: 12+34=?\nA:"
MESSAGES = [{"role": "user", "content": "1+2=?"}]


@pytest.fixture(scope="module")
def samplers(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[tuple[str, subprocess.Popen[bytes]]]]:
    procs = []
    for i in range(2):
        port = free_port()
        run_dir = tmp_path_factory.mktemp(f"gw-s{i}")
        env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "RLFLEET_LOG_LEVEL": "WARNING",
            "RLFLEET_RUN_DIR": str(run_dir),
            "RLFLEET_SAMPLER__MODEL_PATH": str(tiny_model_dir),
            "RLFLEET_SAMPLER__MAX_MODEL_LEN": "256",
            "RLFLEET_SAMPLER__MAX_N": "8",
            "RLFLEET_SAMPLER__SERVED_MODEL_NAME": MODEL,
            "RLFLEET_SAMPLER__SEED": str(i),
        }
        cmd = [
            sys.executable,
            "-m",
            "launch.cli",
            "serve",
            "sampler",
            "--name",
            f"s{i}",
            "--port",
            str(port),
        ]
        log = open(run_dir / "sampler.log", "wb")  # noqa: SIM115
        procs.append(
            (
                f"127.0.0.1:{port}",
                # Own process group: vLLM's engine processes go down with their sampler, as
                # they do when the launcher (or a container runtime) stops a replica.
                subprocess.Popen(
                    cmd,
                    cwd=REPO,
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                ),
            )
        )
    try:
        for address, proc in procs:
            try:
                wait_for_health(address, timeout_s=240, service=SERVICE_NAME)
            except TimeoutError:
                _kill_group(proc, signal.SIGKILL)
                raise
        yield procs
    finally:
        for _, proc in procs:
            _kill_group(proc, signal.SIGTERM)
        for _, proc in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=30)
            _kill_group(proc, signal.SIGKILL)  # whatever of the group is left


def _kill_group(proc: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)


@pytest.fixture(scope="module")
def gw(samplers: list[tuple[str, subprocess.Popen[bytes]]]) -> Iterator[ThreadedGateway]:
    settings = GatewaySettings(
        samplers=[a for a, _ in samplers],
        http_port=0,
        health_interval_s=0.5,
        limits={"max_body_bytes": 65536},
    )
    g = ThreadedGateway(settings, addresses=[a for a, _ in samplers])
    assert len(g.gateway.pool.healthy_backends()) == 2
    yield g
    g.close()


@pytest.fixture
def client(gw: ThreadedGateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_models(client: openai.OpenAI) -> None:
    cards = client.models.list().data
    assert [m.id for m in cards] == [MODEL]


def test_completions_n_logprobs_usage(client: openai.OpenAI) -> None:
    out = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=6,
        n=3,
        logprobs=2,
        seed=7,
        extra_body={"ignore_eos": True},
    )
    assert len(out.choices) == 3 and out.usage.completion_tokens == 18
    assert out.usage.prompt_tokens > 0
    for c in out.choices:
        assert c.finish_reason == "length"
        assert len(c.logprobs.tokens) == 6 and len(c.logprobs.token_logprobs) == 6
        assert all(lp <= 0 for lp in c.logprobs.token_logprobs)
        assert all(2 <= len(top) <= 3 for top in c.logprobs.top_logprobs)
        assert "".join(c.logprobs.tokens) == c.text or c.text in "".join(c.logprobs.tokens)


def test_prompt_list_and_greedy_stream_equals_non_stream(client: openai.OpenAI) -> None:
    prompts = [PROMPT, "Q: 5+6=?\nA:"]
    kw = {"model": MODEL, "prompt": prompts, "max_tokens": 8, "temperature": 0.0}
    full = client.completions.create(**kw)
    assert [c.index for c in full.choices] == [0, 1]
    text = {0: "", 1: ""}
    for chunk in client.completions.create(**kw, stream=True):
        for c in chunk.choices:
            text[c.index] += c.text
    assert text == {c.index: c.text for c in full.choices}


def test_chat_logprobs(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_completion_tokens=5,
        n=2,
        logprobs=True,
        top_logprobs=3,
        temperature=1.0,
    )
    assert len(out.choices) == 2
    for c in out.choices:
        assert c.message.role == "assistant" and isinstance(c.message.content, str)
        assert 1 <= len(c.logprobs.content) <= 5
        assert all(len(t.top_logprobs) == 3 for t in c.logprobs.content)
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens


def test_chat_stream_with_usage(client: openai.OpenAI) -> None:
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            max_tokens=6,
            stream=True,
            temperature=0.0,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens >= 1
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    full = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0.0
    )
    assert text == full.choices[0].message.content


async def test_async_client_concurrent_streams(gw: ThreadedGateway) -> None:
    client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0, timeout=120)

    async def one(i: int) -> tuple[int, int]:
        stream = await client.completions.create(
            model=MODEL,
            prompt=f"Q: {i}+1=?\nA:",
            max_tokens=8,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        chunks = [c async for c in stream]
        usage = chunks[-1].usage
        return sum(len(c.choices) for c in chunks), usage.completion_tokens if usage else 0

    results = await asyncio.gather(*(one(i) for i in range(8)))
    # 8 tokens each with ignore_eos; a busy engine may send several tokens in one chunk.
    assert all(tokens == 8 and 1 <= chunks <= 8 for chunks, tokens in results), results
    await client.close()
    # both replicas served some
    from gateway import metrics

    served = [
        metrics.BACKEND_REQUESTS.labels(b.address)._value.get() for b in gw.gateway.pool.backends
    ]
    assert all(s > 0 for s in served)


def error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    return r.json()["error"]


def test_errors(gw: ThreadedGateway) -> None:
    url = gw.url + "/v1/completions"
    e = error(httpx.post(url, json={"model": MODEL, "prompt": PROMPT, "n": 9}), 400)
    assert e["param"] == "n"  # the sampler's INVALID_ARGUMENT (max_n 8)
    e = error(httpx.post(url, json={"model": MODEL, "prompt": "1 " * 400}), 400)
    assert e["param"] == "prompt"
    e = error(httpx.post(url, json={"model": MODEL, "prompt": PROMPT, "max_tokens": 300}), 400)
    assert e["code"] == "context_length_exceeded"
    e = error(httpx.post(url, json={"model": "gpt-4", "prompt": PROMPT}), 404)
    assert e["code"] == "model_not_found"
    error(httpx.post(url, json={"model": MODEL, "prompt": "x" * 70000}), 413)
    e = error(
        httpx.post(
            gw.url + "/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, "top_p": 0}
        ),
        400,
    )
    assert e["param"] == "top_p"


def test_api_keys(samplers: list[tuple[str, subprocess.Popen[bytes]]]) -> None:
    addresses = [a for a, _ in samplers]
    settings = GatewaySettings(samplers=addresses, http_port=0, api_keys=[{"key": "k-1", "rpm": 1}])
    g = ThreadedGateway(settings, addresses=addresses)
    try:
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=g.url + "/v1", api_key="bad", max_retries=0).models.list()
        c = openai.OpenAI(base_url=g.url + "/v1", api_key="k-1", max_retries=0)
        c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1)
        with pytest.raises(openai.RateLimitError) as info:
            c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1)
        assert int(info.value.response.headers["retry-after"]) >= 1
    finally:
        g.close()


def test_disconnect_frees_the_backend(gw: ThreadedGateway) -> None:
    with httpx.stream(
        "POST",
        gw.url + "/v1/completions",
        timeout=60,
        json={
            "model": MODEL,
            "prompt": PROMPT,
            "max_tokens": 200,
            "stream": True,
            "ignore_eos": True,
        },
    ) as r:
        assert r.status_code == 200
        next(r.iter_lines())

    async def drained() -> None:
        async with asyncio.timeout(10):
            while any(b.outstanding for b in gw.gateway.pool.backends):
                await asyncio.sleep(0.02)

    gw.call(drained())


def test_health_and_metrics(gw: ThreadedGateway) -> None:
    health = httpx.get(gw.url + "/health").json()
    assert health["status"] == "ok" and all(b["healthy"] for b in health["backends"])
    text = httpx.get(gw.url + "/metrics").text
    assert "rlfleet_gateway_ttft_seconds_count" in text


def test_replica_killed_mid_run(
    gw: ThreadedGateway, samplers: list[tuple[str, subprocess.Popen[bytes]]]
) -> None:
    """Kill one replica while requests run: no 5xx, new requests go to the healthy one."""
    victim_address, victim = samplers[1]

    async def run() -> list[int]:
        statuses: list[int] = []
        async with httpx.AsyncClient(base_url=gw.url, timeout=120) as http:

            async def one(i: int, stream: bool) -> None:
                body = {
                    "model": MODEL,
                    "prompt": f"Q: {i}+2=?\nA:",
                    "max_tokens": 16,
                    "stream": stream,
                    "ignore_eos": True,
                }
                if stream:
                    async with http.stream("POST", "/v1/completions", json=body) as r:
                        statuses.append(r.status_code)
                        async for _ in r.aiter_lines():
                            pass
                else:
                    r = await http.post("/v1/completions", json=body)
                    statuses.append(r.status_code)

            loop = asyncio.get_running_loop()
            tasks = [asyncio.ensure_future(one(i, i % 2 == 0)) for i in range(8)]
            await asyncio.sleep(0.3)
            await loop.run_in_executor(None, _kill_group, victim, signal.SIGKILL)
            tasks += [asyncio.ensure_future(one(i, i % 2 == 0)) for i in range(8, 24)]
            await asyncio.gather(*tasks)
        return statuses

    statuses = gw.call(run(), timeout=300)
    assert len(statuses) == 24
    assert all(s < 500 for s in statuses), statuses
    assert all(s == 200 for s in statuses), statuses
    victim.wait(10)
    backend = next(b for b in gw.gateway.pool.backends if b.address == victim_address)
    assert not backend.healthy
    # afterwards everything goes to the survivor
    c = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0, timeout=120)
    for _ in range(4):
        c.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
    assert json.loads(httpx.get(gw.url + "/health").text)["status"] == "ok"
