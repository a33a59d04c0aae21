"""The runtime's calling helpers (services/calls.py, services/grpc_names.py) and the sampler's
client (clients/sampler.py) against a fake SamplerService on a loopback GrpcServer: no model.

The fake answers Generate with one completion per prompt whose text names the replica, and
raises what the prompt text asks for ("invalid", "busy"), so the tests see which replica
answered and how errors come back.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import grpc
import pytest
import pytest_asyncio

from clients.reward import SERVICE_NAME as REWARD_SERVICE
from clients.sampler import SERVICE_NAME, SamplerClient, SamplerPool
from rlfleet.env.v1 import env_pb2
from rlfleet.learner.v1 import learner_pb2, weights_pb2
from rlfleet.reward.v1 import reward_pb2
from rlfleet.sampler.v1 import sampler_pb2, sampler_pb2_grpc
from services.calls import RETRIED, call_with_retry, rpc, wait_healthy
from services.errors import InvalidArgument, NotFound, ResourceExhausted, RlfleetError
from services.grpc_names import method_path, service_name
from services.ports import free_port
from services.server import GrpcServer

pytestmark = pytest.mark.timeout(60)

# --------------------------------------------------------------------------- grpc_names


def test_service_names_come_from_the_descriptors() -> None:
    assert service_name(sampler_pb2, "SamplerService") == "rlfleet.sampler.v1.SamplerService"
    assert service_name(reward_pb2.DESCRIPTOR, "RewardService") == "rlfleet.reward.v1.RewardService"
    assert service_name(env_pb2, "EnvService") == "rlfleet.env.v1.EnvService"
    assert service_name(learner_pb2, "LearnerService") == "rlfleet.learner.v1.LearnerService"
    assert SERVICE_NAME == "rlfleet.sampler.v1.SamplerService"
    assert REWARD_SERVICE == "rlfleet.reward.v1.RewardService"
    assert (
        method_path(weights_pb2, "WeightService", "FetchWeights")
        == "/rlfleet.learner.v1.WeightService/FetchWeights"
    )


def test_unknown_names_say_what_there_is() -> None:
    with pytest.raises(KeyError, match=r"no service 'Sampler'.*has: SamplerService"):
        service_name(sampler_pb2, "Sampler")
    with pytest.raises(KeyError, match=r"no method 'Fetch'.*FetchWeights, GetManifest"):
        method_path(weights_pb2, "WeightService", "Fetch")
    with pytest.raises(TypeError, match="_pb2 module"):
        service_name(object(), "SamplerService")


# --------------------------------------------------------------------------- a fake sampler


class FakeSampler(sampler_pb2_grpc.SamplerServiceServicer):
    def __init__(self, name: str) -> None:
        self.name = name
        self.busy = 0  # this many Generate calls answer RESOURCE_EXHAUSTED first

    async def Generate(
        self, request: sampler_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> sampler_pb2.GenerateResponse:
        text = request.prompts[0].text
        if text == "invalid":
            raise InvalidArgument("prompt too long", field="prompts[0].text")
        if text == "busy" and self.busy > 0:
            self.busy -= 1
            raise ResourceExhausted("queue full")
        if text == "slow":
            await asyncio.sleep(5)
        completion = sampler_pb2.Completion(text=f"{self.name}:{text}:n={request.sampling.n}")
        return sampler_pb2.GenerateResponse(
            results=[sampler_pb2.PromptResult(completions=[completion]) for _ in request.prompts]
        )

    async def GetInfo(
        self, request: sampler_pb2.GetInfoRequest, context: grpc.aio.ServicerContext
    ) -> sampler_pb2.GetInfoResponse:
        return sampler_pb2.GetInfoResponse(model_name=self.name, policy_version=7)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def samplers() -> AsyncIterator[list[tuple[str, FakeSampler]]]:
    servers, out = [], []
    add = sampler_pb2_grpc.add_SamplerServiceServicer_to_server
    for name in ("a", "b"):
        fake = FakeSampler(name)
        server = GrpcServer(f"fake-{name}", port=free_port())
        server.add_service(add, fake, SERVICE_NAME)
        await server.start()
        server.set_serving()
        servers.append(server)
        out.append((server.address, fake))
    yield out
    for server in servers:
        await server.stop(0)


def _request(text: str, n: int = 1) -> sampler_pb2.GenerateRequest:
    return sampler_pb2.GenerateRequest(
        prompts=[sampler_pb2.Prompt(text=text)], sampling=sampler_pb2.SamplingParams(n=n)
    )


# --------------------------------------------------------------------------- sampler client


async def test_client_builds_requests_and_names_the_peer_in_errors(
    samplers: list[tuple[str, FakeSampler]],
) -> None:
    address, _ = samplers[0]
    async with SamplerClient(address, timeout_s=10) as client:
        reply = await client.generate(["hi"], n=3)
        assert reply.results[0].completions[0].text == "a:hi:n=3"
        raw = await client.generate_request(_request("raw"))
        assert raw.results[0].completions[0].text == "a:raw:n=1"
        assert (await client.info()).model_name == "a"
        with pytest.raises(InvalidArgument) as caught:
            await client.generate(["invalid"])
        assert caught.value.field == "prompts[0].text"  # the server's field survives
        assert caught.value.message == f"sampler {address}: Generate: prompt too long"
        assert str(caught.value) == caught.value.message
        with pytest.raises(RlfleetError, match=f"sampler {address}: Generate") as late:
            await client.generate(["slow"], deadline_s=0.2)  # the gRPC deadline fails the call
        assert late.value.code == grpc.StatusCode.DEADLINE_EXCEEDED


async def test_pool_takes_turns_and_says_who_answered(
    samplers: list[tuple[str, FakeSampler]],
) -> None:
    addresses = [address for address, _ in samplers]
    async with SamplerPool(addresses, timeout_s=10) as pool:
        assert pool.addresses == addresses
        answers = [await pool.generate(_request(f"p{i}")) for i in range(4)]
        assert [who for who, _ in answers] == [*addresses, *addresses]
        texts = [reply.results[0].completions[0].text for _, reply in answers]
        assert texts == ["a:p0:n=1", "b:p1:n=1", "a:p2:n=1", "b:p3:n=1"]
        assert [(await pool.info(i)).model_name for i in range(2)] == ["a", "b"]
    with pytest.raises(ValueError, match="no sampler"):
        SamplerPool([])


# --------------------------------------------------------------------------- calls


async def test_call_with_retry_retries_only_transient_errors(
    samplers: list[tuple[str, FakeSampler]],
) -> None:
    address, fake = samplers[1]
    stop = asyncio.Event()
    async with SamplerClient(address, timeout_s=10) as client:
        fake.busy = 2
        reply = await call_with_retry(
            lambda: client.generate_request(_request("busy")), "busy", stop, first_delay_s=0.01
        )
        assert reply is not None and reply.results[0].completions[0].text == "b:busy:n=1"
        assert fake.busy == 0
        with pytest.raises(InvalidArgument, match=f"sampler {address}: Generate"):
            await call_with_retry(lambda: client.generate_request(_request("invalid")), "bad", stop)
        # Stopped while backing off: None, without waiting out the delay.
        fake.busy = 100
        asyncio.get_running_loop().call_later(0.2, stop.set)
        started = time.monotonic()
        assert (
            await call_with_retry(
                lambda: client.generate_request(_request("busy")), "busy", stop, first_delay_s=30
            )
            is None
        )
        assert time.monotonic() - started < 5
        fake.busy = 0
        # Failing once stopped (the callee shutting down with the run): None, not the error.
        assert (
            await call_with_retry(
                lambda: client.generate_request(_request("invalid")), "stopping", stop
            )
            is None
        )
    assert grpc.StatusCode.UNAVAILABLE in RETRIED
    assert grpc.StatusCode.INVALID_ARGUMENT not in RETRIED


async def test_rpc_leaves_other_exceptions_alone() -> None:
    async def fails() -> None:
        raise NotFound("plain")

    with pytest.raises(NotFound, match=r"^plain$"):
        await rpc("peer", fails())


async def test_wait_healthy(samplers: list[tuple[str, FakeSampler]]) -> None:
    address, _ = samplers[0]
    stop = asyncio.Event()
    assert await wait_healthy("sampler", address, SERVICE_NAME, stop, 10)
    nobody = f"127.0.0.1:{free_port()}"
    with pytest.raises(TimeoutError, match=f"sampler at {nobody} not healthy after 0.5s"):
        await wait_healthy("sampler", nobody, SERVICE_NAME, stop, 0.5)
    asyncio.get_running_loop().call_later(0.1, stop.set)
    assert not await wait_healthy("sampler", nobody, SERVICE_NAME, stop, 30)  # stopped: False
