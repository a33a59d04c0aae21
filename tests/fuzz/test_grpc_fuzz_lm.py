"""Property-based fuzzing of the language-model sampler and the learner's weight service.

The same property as test_grpc_fuzz.py (never INTERNAL, UNKNOWN or a hang; still serving
after), against the session's shared stack (tests/fixtures/lm.py: one real vLLM engine behind
SamplerService, and a real WeightService), so it costs no second engine. Fewer examples than
the env server gets: every request that passes validation runs the engine.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncIterator

import grpc
import pytest
from google.protobuf import duration_pb2
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlfleet.common.v1 import tensor_pb2
from rlfleet.learner.v1 import weights_pb2
from rlfleet.sampler.v1 import sampler_pb2
from tests.fixtures.lm import LmStack
from tests.fuzz.proto_strategies import messages, mutations

pytestmark = pytest.mark.slow

BUGS = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.DEADLINE_EXCEEDED}
DEADLINE_S = 60.0
FUZZ = settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                           HealthCheck.data_too_large],
    database=None,
)  # fmt: skip
TRIED: Counter[str] = Counter()

SAMPLING = sampler_pb2.SamplingParams(n=2, max_tokens=4, temperature=1.0, seed=3, logprobs=True)
GENERATE = sampler_pb2.GenerateRequest(
    prompts=[sampler_pb2.Prompt(text="Q: 1+1=?\nA:")],
    sampling=SAMPLING,
    timeout=duration_pb2.Duration(seconds=20),
)
HELLO = sampler_pb2.ChatMessage(role="user", content="hi")
CHAT = sampler_pb2.GenerateRequest(
    prompts=[sampler_pb2.Prompt(chat=sampler_pb2.ChatPrompt(messages=[HELLO]))],
    sampling=SAMPLING,
)
TOKENS = sampler_pb2.GenerateStreamRequest(
    prompt=sampler_pb2.Prompt(
        token_ids=tensor_pb2.Tensor(dtype=tensor_pb2.D_TYPE_INT32, shape=[2], data=bytes(8))
    ),
    sampling=sampler_pb2.SamplingParams(max_tokens=3),
)


@pytest.fixture(scope="module", autouse=True)
def report() -> AsyncIterator[None]:
    yield  # type: ignore[misc]
    lines = [f"fuzz (lm): {sum(TRIED.values())} bad or random requests tried"]
    print("\n".join(lines + [f"  {k}: {n}" for k, n in sorted(TRIED.items())]))


@pytest.fixture(scope="module")
async def sampler_channel(lm_stack: LmStack) -> AsyncIterator[grpc.aio.Channel]:
    async with grpc.aio.insecure_channel(lm_stack.address) as ch:
        yield ch


@pytest.fixture(scope="module")
async def weights_channel(lm_stack: LmStack) -> AsyncIterator[grpc.aio.Channel]:
    async with grpc.aio.insecure_channel(lm_stack.learner_address) as ch:
        yield ch


async def unary(ch: grpc.aio.Channel, method: str, request: bytes) -> None:
    rpc = ch.unary_unary(method, request_serializer=None, response_deserializer=None)
    try:
        await rpc(request, timeout=DEADLINE_S)
        TRIED[f"{method} OK"] += 1
    except grpc.aio.AioRpcError as err:
        TRIED[f"{method} {err.code().name}"] += 1
        assert err.code() not in BUGS, f"{method}: {err.code()} {err.details()}"


async def server_stream(ch: grpc.aio.Channel, method: str, request: bytes) -> None:
    rpc = ch.unary_stream(method, request_serializer=None, response_deserializer=None)
    try:
        async for _ in rpc(request, timeout=DEADLINE_S):
            pass
        TRIED[f"{method} OK"] += 1
    except grpc.aio.AioRpcError as err:
        TRIED[f"{method} {err.code().name}"] += 1
        assert err.code() not in BUGS, f"{method}: {err.code()} {err.details()}"


@FUZZ
@given(request=st.one_of(messages(sampler_pb2.GenerateRequest.DESCRIPTOR, depth=3),
                         mutations(GENERATE), mutations(CHAT)))  # fmt: skip
async def test_generate(
    sampler_channel: grpc.aio.Channel, request: sampler_pb2.GenerateRequest
) -> None:
    await unary(sampler_channel, "/rlfleet.sampler.v1.SamplerService/Generate",
                request.SerializeToString())  # fmt: skip


@FUZZ
@given(request=st.one_of(messages(sampler_pb2.GenerateStreamRequest.DESCRIPTOR, depth=3),
                         mutations(TOKENS)))  # fmt: skip
async def test_generate_stream(
    sampler_channel: grpc.aio.Channel, request: sampler_pb2.GenerateStreamRequest
) -> None:
    await server_stream(sampler_channel, "/rlfleet.sampler.v1.SamplerService/GenerateStream",
                        request.SerializeToString())  # fmt: skip


@FUZZ
@given(data=st.binary(max_size=48), which=st.sampled_from(["GetInfo", "Generate"]))
async def test_sampler_undecodable(
    sampler_channel: grpc.aio.Channel, data: bytes, which: str
) -> None:
    await unary(sampler_channel, f"/rlfleet.sampler.v1.SamplerService/{which}", data)


FETCH = weights_pb2.FetchWeightsRequest(version=0, max_chunk_bytes=1 << 20)


@FUZZ
@given(
    manifest=messages(weights_pb2.GetManifestRequest.DESCRIPTOR),
    fetch=st.one_of(messages(weights_pb2.FetchWeightsRequest.DESCRIPTOR), mutations(FETCH)),
    versions=messages(weights_pb2.ListVersionsRequest.DESCRIPTOR),
)
async def test_weight_service(
    weights_channel: grpc.aio.Channel,
    manifest: weights_pb2.GetManifestRequest,
    fetch: weights_pb2.FetchWeightsRequest,
    versions: weights_pb2.ListVersionsRequest,
) -> None:
    base = "/rlfleet.learner.v1.WeightService/"
    await unary(weights_channel, base + "GetManifest", manifest.SerializeToString())
    await server_stream(weights_channel, base + "FetchWeights", fetch.SerializeToString())
    await unary(weights_channel, base + "ListVersions", versions.SerializeToString())


async def test_still_serving_after_the_fuzz(lm_stack: LmStack) -> None:
    from clients.sampler import SamplerClient

    async with SamplerClient(lm_stack.address, timeout_s=120) as client:
        reply = await client.generate(["Q: 2+2=?\nA:"], n=1, max_tokens=3, seed=1)
    assert len(reply.results[0].completions) == 1
