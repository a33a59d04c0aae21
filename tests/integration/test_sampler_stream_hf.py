"""GenerateStream and `SamplerClient.stream` on a serve-mode sampler over the transformers
reference engine (no vLLM, so it runs in the fast suite): the stream equals Generate, the
client's errors and cancellation (aclose and garbage collection) reach the engine.

The vLLM behaviour (token-by-token deltas, n > 1 interleaving, abort) is in
tests/contract/test_sampler_stream.py.
"""

from __future__ import annotations

import asyncio
import gc
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from clients.sampler import SamplerClient, to_prompt
from common import tensor
from rlfleet.sampler.v1 import sampler_pb2
from services.errors import InvalidArgument, Unavailable
from tests.fixtures.lm import ServingSampler, serving_sampler

PROMPT = "Q: 12+34=?\nA:"
FINISH = sampler_pb2.FinishReason


@pytest.fixture(scope="module")
async def served(tiny_model_dir: Path, _sampler_env: Path) -> AsyncIterator[ServingSampler]:
    async with serving_sampler(tiny_model_dir, _sampler_env, engine="hf", max_n=8) as s:
        yield s


@pytest.fixture
async def client(served: ServingSampler) -> AsyncIterator[SamplerClient]:
    async with SamplerClient(served.address, timeout_s=120) as c:
        yield c


def request(prompt: Any = PROMPT, **sampling: Any) -> sampler_pb2.GenerateStreamRequest:
    return sampler_pb2.GenerateStreamRequest(
        prompt=to_prompt(prompt), sampling=sampler_pb2.SamplingParams(**sampling)
    )


async def messages(client: SamplerClient, req: Any) -> list[sampler_pb2.GenerateStreamResponse]:
    return [m async for m in client.stream(req)]


async def test_stream_equals_generate(served: ServingSampler, client: SamplerClient) -> None:
    assert served.sampler.warmup_s is not None  # warmed up before SERVING
    kw = {"temperature": 0.0, "max_tokens": 12, "ignore_eos": True, "logprobs": True}
    unary = (await client.generate([PROMPT], **kw)).results[0]
    got = await messages(client, request(**kw, top_logprobs=2))
    assert got[0].WhichOneof("event") == "start"
    assert (
        tensor.decode(got[0].start.prompt_token_ids).tolist()
        == tensor.decode(unary.prompt_token_ids).tolist()
    )
    deltas = [m.delta for m in got[1:]]
    want = unary.completions[0]
    tokens = [t for d in deltas for t in tensor.decode(d.token_ids).tolist()]
    assert tokens == tensor.decode(want.token_ids).tolist()
    assert "".join(d.text for d in deltas) == want.text
    assert deltas[-1].finish_reason == FINISH.FINISH_REASON_LENGTH
    logprobs = np.concatenate([tensor.decode(d.logprobs) for d in deltas])
    np.testing.assert_allclose(logprobs, tensor.decode(want.logprobs), atol=1e-5)
    assert sum(len(d.token_texts) for d in deltas) == len(tokens)
    assert sum(len(d.top_token_texts) for d in deltas) == 2 * len(tokens)


async def test_stop_string_is_removed(client: SamplerClient) -> None:
    base = {"temperature": 0.0, "max_tokens": 24, "ignore_eos": True}
    text = (await client.generate([PROMPT], **base)).results[0].completions[0].text
    stop = next(ch for ch in text[1:] if ch.isascii() and ch.isprintable() and ch != " ")
    unary = (await client.generate([PROMPT], **base, stop=[stop])).results[0].completions[0]
    deltas = [m.delta for m in (await messages(client, request(**base, stop=[stop])))[1:]]
    assert "".join(d.text for d in deltas) == unary.text == text[: text.find(stop)]
    assert deltas[-1].finish_reason == FINISH.FINISH_REASON_STOP


async def test_errors_are_runtime_classes(client: SamplerClient) -> None:
    with pytest.raises(InvalidArgument) as info:
        await messages(client, request(top_p=2.0))
    assert info.value.field == "sampling.top_p"
    assert str(info.value).startswith(f"sampler {client.address}: GenerateStream: ")
    with pytest.raises(InvalidArgument) as info:
        await messages(client, sampler_pb2.GenerateStreamRequest())
    assert info.value.field == "prompt"
    async with SamplerClient("127.0.0.1:1", timeout_s=2) as nowhere:
        with pytest.raises(Unavailable):
            await messages(nowhere, request())


async def wait_idle(served: ServingSampler, within_s: float) -> None:
    engine, servicer = served.sampler.engine, served.sampler.servicer
    deadline = time.monotonic() + within_s
    while engine.unfinished_requests() or servicer.queued:
        assert time.monotonic() < deadline, "the engine still runs the cancelled request"
        await asyncio.sleep(0.01)


async def test_closing_or_dropping_the_stream_cancels(
    served: ServingSampler, client: SamplerClient
) -> None:
    long = request(n=4, temperature=1.0, ignore_eos=True)  # until the context runs out
    for how in ("aclose", "garbage"):
        stream = client.stream(long)
        assert (await anext(stream)).WhichOneof("event") == "start"
        await asyncio.sleep(0.2)
        assert served.sampler.engine.unfinished_requests() == 1
        if how == "aclose":
            await stream.aclose()  # type: ignore[attr-defined]
            with pytest.raises(StopAsyncIteration):
                await anext(stream)
        else:
            del stream
            gc.collect()
        await wait_idle(served, within_s=5.0)
    started = time.monotonic()
    await client.generate([PROMPT], temperature=0.0, max_tokens=4)
    assert time.monotonic() - started < 5.0


@pytest.mark.parametrize("stop", [(), ("ab", "never-zz"), ("\n",)])
def test_stream_text_pieces_join_to_the_decode(tiny_model_dir: Path, stop: tuple[str, ...]) -> None:
    """Token by token, over random ids (odd bytes, partial UTF-8): the pieces only ever extend
    the final text, never show a stop string, and join to Generate's text."""
    from transformers import AutoTokenizer

    from sampler.lm.servicer import _StreamText

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    rng = np.random.default_rng(0)
    for _ in range(5):
        tokens = rng.integers(0, len(tokenizer), 120).tolist()
        full = tokenizer.decode(tokens, skip_special_tokens=True)
        hits = [i for i in (full.find(s) for s in stop) if i >= 0]
        want = full[: min(hits, default=len(full))]
        text, sent = _StreamText(tokenizer, stop), ""
        for i, token in enumerate(tokens):
            sent += text.add([token], finished=i == len(tokens) - 1)
            assert want.startswith(sent)
            assert not any(s in sent for s in stop)
        assert sent == want
