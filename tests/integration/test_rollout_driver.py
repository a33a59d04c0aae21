"""The whole rollout driver (sampler/rollout/driver.py) against a fake SamplerService, the real
RewardService and a real nats-server: groups reach the trajectory stream, calls go round-robin
over the samplers, and a RunStatus saying the run is over stops the driver.

The fake sampler answers every prompt with ``n`` completions " <answer>5</answer>" (three
tokens, the same for every prompt), so the accuracy reward scores them by the task's answer.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any

import grpc
import numpy as np
import pytest
import pytest_asyncio

from clients.reward import SERVICE_NAME as REWARD_SERVICE
from clients.sampler import SERVICE_NAME as SAMPLER_SERVICE
from common import tensor
from reward_service.service import serve
from reward_service.settings import RewardSettings
from rlfleet.bus.v1 import events_pb2, trajectory_pb2
from rlfleet.sampler.v1 import sampler_pb2, sampler_pb2_grpc
from sampler.rollout.driver import RolloutDriver
from sampler.rollout.settings import RewardSpec, RolloutSettings
from services.bus import Bus, EmbeddedNats, events_subject, stream_name, traj_subject
from services.calls import wait_healthy
from services.ports import free_port
from services.registry import ServiceContext
from services.server import GrpcServer
from tests.fixtures.rollout import driver_groups

pytestmark = pytest.mark.timeout(90)


class FakeSampler(sampler_pb2_grpc.SamplerServiceServicer):
    def __init__(self) -> None:
        self.calls = 0

    async def Generate(
        self, request: sampler_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> sampler_pb2.GenerateResponse:
        self.calls += 1
        completion = sampler_pb2.Completion(
            token_ids=tensor.encode(np.array([1, 2, 3], dtype=np.int32)),
            logprobs=tensor.encode(np.full(3, -0.5, dtype=np.float32)),
            text=" <answer>5</answer>",
            finish_reason=sampler_pb2.FINISH_REASON_STOP,
        )
        result = sampler_pb2.PromptResult(
            prompt_token_ids=tensor.encode(np.arange(4, dtype=np.int32)),
            completions=[completion] * request.sampling.n,
        )
        return sampler_pb2.GenerateResponse(results=[result] * len(request.prompts))

    async def GetInfo(
        self, request: sampler_pb2.GetInfoRequest, context: grpc.aio.ServicerContext
    ) -> sampler_pb2.GetInfoResponse:
        return sampler_pb2.GetInfoResponse(model_name="fake", policy_version=0)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def peers() -> AsyncIterator[tuple[list[tuple[str, FakeSampler]], str]]:
    ctx = ServiceContext(name="rewards", kind="reward_service", settings=RewardSettings())
    ctx.port = free_port()
    serving = asyncio.create_task(serve(ctx, entry_points=[]))
    rewards = f"127.0.0.1:{ctx.port}"
    samplers, servers = [], []
    for i in range(2):
        fake = FakeSampler()
        server = GrpcServer(f"fake-sampler-{i}", port=free_port())
        server.add_service(
            sampler_pb2_grpc.add_SamplerServiceServicer_to_server, fake, SAMPLER_SERVICE
        )
        await server.start()
        server.set_serving()
        servers.append(server)
        samplers.append((server.address, fake))
    assert await wait_healthy("reward service", rewards, REWARD_SERVICE, asyncio.Event(), 30)
    yield samplers, rewards
    for server in servers:
        await server.stop(0)
    ctx.stop_event.set()
    await asyncio.wait_for(serving, 30)


async def test_driver_publishes_scored_groups_until_the_run_is_over(
    peers: tuple[list[tuple[str, FakeSampler]], str], nats_server: EmbeddedNats
) -> None:
    samplers, rewards = peers
    run = f"t{uuid.uuid4().hex[:10]}"
    settings = RolloutSettings(
        sampler=[address for address, _ in samplers],
        reward_service=rewards,
        dataset={"generator": "arith", "seed": 3},
        feed=True,
        group_size=2,
        prompts_per_call=2,
        concurrency=1,
        rewards=[RewardSpec(name="accuracy")],
        startup_timeout_s=30,
    )
    before = [fake.calls for _, fake in samplers]
    groups = await driver_groups(settings, run, nats_server.url, 4)
    assert len({g.group_id for g in groups}) == 4
    for group in groups:
        assert len(group.completions) == 2
        assert [s.name for s in group.completions[0].rewards] == ["accuracy"]
        assert {c.reward for c in group.completions} <= {0.0, 1.0}
    calls = [fake.calls - b for (_, fake), b in zip(samplers, before, strict=True)]
    assert min(calls) >= 1 and max(calls) - min(calls) <= 1  # in turn over both samplers


async def test_a_paced_driver_starts_another_group_for_each_one_the_learner_drops(
    peers: tuple[list[tuple[str, FakeSampler]], str], nats_server: EmbeddedNats
) -> None:
    """No new version comes; the learner's GroupsDropped for this driver's own groups (not
    another driver's) is what lets it start more."""
    samplers, rewards = peers
    run = f"t{uuid.uuid4().hex[:10]}"
    settings = RolloutSettings(
        sampler=[samplers[0][0]],
        reward_service=rewards,
        dataset={"generator": "arith", "seed": 4},
        feed=True,
        group_size=2,
        prompts_per_call=1,
        concurrency=1,
        rewards=[RewardSpec(name="accuracy")],
        groups_per_version=2,
        max_policy_lag=0,
        startup_timeout_s=30,
    )
    ctx = ServiceContext(
        name="rollout-0", kind="rollout", settings=settings, run_name=run, nats_url=nats_server.url
    )
    running = asyncio.create_task(RolloutDriver(ctx, settings).run())
    subject = events_subject(run, "dropped")

    def dropped(producer: str, groups: list[trajectory_pb2.TrajectoryGroup]) -> Any:
        return events_pb2.GroupsDropped(
            run=run,
            source="learner",
            producer=producer,
            count=len(groups),
            reason="uniform",
            group_ids=[g.group_id for g in groups],
        )

    async with Bus.connect(nats_server.url, name="test-learner") as bus:
        for _ in range(100):
            try:
                await bus.js.stream_info(stream_name(run))
                break
            except Exception:
                await asyncio.sleep(0.1)
        pulled = bus.pull(
            stream_name(run), "learner", traj_subject(run), trajectory_pb2.TrajectoryGroup
        )
        arrived: asyncio.Queue[trajectory_pb2.TrajectoryGroup] = asyncio.Queue()

        async def collect() -> None:  # a timed-out anext() would close the pull iterator
            async for delivery in pulled:
                await delivery.ack()
                await arrived.put(delivery.message)

        collecting = asyncio.create_task(collect())

        async def next_group(timeout_s: float) -> trajectory_pb2.TrajectoryGroup | None:
            try:
                return await asyncio.wait_for(arrived.get(), timeout_s)
            except TimeoutError:
                return None

        first = []
        for _ in range(2):  # the credit of version 0
            group = await next_group(20)
            assert group is not None and group.source == "rollout-0"
            first.append(group)
        assert await next_group(1.5) is None  # waits for version 1
        await bus.publish_event(subject, dropped("rollout-1", first))  # not this driver's
        assert await next_group(1.5) is None
        await bus.publish_event(subject, dropped("rollout-0", first[:1]))
        third = await next_group(20)
        assert third is not None and third.group_id not in {g.group_id for g in first}
        assert await next_group(1.5) is None  # one group per credit
        collecting.cancel()
        await asyncio.gather(collecting, return_exceptions=True)
        await pulled.aclose()
        assert not running.done()
        done = events_pb2.RunStatus(run=run, state=events_pb2.RUN_STATE_DONE, source="test")
        await bus.publish_event(events_subject(run, "status"), done)
        await asyncio.wait_for(running, 20)
