"""The driver's scoring and publishing half against a real RewardService and nats-server.

The sampler's half needs a language model; its GenerateResponse here is data written out by
hand (what a sampler answers), scored by the real reward service and published for real.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import numpy as np
import pytest
import pytest_asyncio

from clients.reward import SERVICE_NAME as REWARD_SERVICE
from clients.reward import RewardClient
from clients.trajectories.prompts import prompt_task
from common import tensor
from common.datasets import Task
from reward_service.service import serve
from reward_service.settings import RewardSettings
from rlfleet.bus.v1 import trajectory_pb2
from rlfleet.sampler.v1 import sampler_pb2
from sampler.rollout.groups import build_groups, score_request
from sampler.rollout.settings import RewardSpec
from services.bus import Bus, EmbeddedNats, stream_name, traj_subject
from services.calls import call_with_retry, wait_healthy
from services.errors import InvalidArgument
from services.ports import free_port
from services.registry import ServiceContext

pytestmark = pytest.mark.timeout(60)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def rewards() -> AsyncIterator[str]:
    ctx = ServiceContext(name="rewards", kind="reward_service", settings=RewardSettings())
    ctx.port = free_port()
    serving = asyncio.create_task(serve(ctx, entry_points=[]))
    address = f"127.0.0.1:{ctx.port}"
    assert await wait_healthy("reward service", address, REWARD_SERVICE, asyncio.Event(), 30)
    yield address
    ctx.stop_event.set()
    await asyncio.wait_for(serving, 30)


def _completion(text: str, ids: list[int]) -> sampler_pb2.Completion:
    return sampler_pb2.Completion(
        token_ids=tensor.encode(np.array(ids, dtype=np.int32)),
        logprobs=tensor.encode(np.full(len(ids), -0.5, dtype=np.float32)),
        text=text,
        finish_reason=sampler_pb2.FINISH_REASON_STOP,
        policy_version=4,
        end_policy_version=4,
    )


async def test_groups_scored_by_the_reward_service_reach_the_stream(
    rewards: str, nats_server: EmbeddedNats
) -> None:
    run = f"t{uuid.uuid4().hex[:10]}"
    task = prompt_task(
        run, "arith:train:0", 0, Task("p0", prompt="Q: 2+3=?\nA:", extra={"answer": "5"})
    )
    result = sampler_pb2.PromptResult(
        prompt_token_ids=tensor.encode(np.arange(6, dtype=np.int32)),
        completions=[_completion(" <answer>5</answer>", [1, 2, 3]), _completion(" 6", [4])],
    )
    request = score_request([task], [result], [None], [RewardSpec(name="accuracy")])
    async with RewardClient(rewards, timeout_s=30) as client:
        scored = await call_with_retry(
            lambda: client.score_request(request), "score", asyncio.Event()
        )
    assert scored is not None
    (group,) = build_groups(run, "rollout-0", [task], [result], [None], list(scored.results))
    assert [c.reward for c in group.completions] == [1.0, 0.0]
    assert [s.name for s in group.completions[0].rewards] == ["accuracy"]

    async with Bus.connect(nats_server.url, name="rollout-scoring") as bus:
        await bus.ensure_stream(stream_name(run), [traj_subject(run)])
        first = await bus.publish(traj_subject(run), group, msg_id=group.group_id)
        again = await bus.publish(traj_subject(run), group, msg_id=group.group_id)
        assert not first.duplicate and again.duplicate  # a retried group is stored once
        pulled = bus.pull(
            stream_name(run), "learner", traj_subject(run), trajectory_pb2.TrajectoryGroup
        )
        delivery = await asyncio.wait_for(anext(pulled), 10)
        await delivery.ack()
        await pulled.aclose()
    assert delivery.message == group


async def test_unknown_reward_is_fatal_with_the_servers_message(rewards: str) -> None:
    task = prompt_task("r", "d", 0, Task("p0", prompt="hi"))
    result = sampler_pb2.PromptResult(
        prompt_token_ids=tensor.encode(np.arange(2, dtype=np.int32)),
        completions=[_completion("x", [1])],
    )
    request = score_request([task], [result], [None], [RewardSpec(name="acuracy")])
    async with RewardClient(rewards, timeout_s=30) as client:
        with pytest.raises(InvalidArgument, match=r"reward service .*: unknown reward 'acuracy'"):
            await asyncio.wait_for(
                call_with_retry(lambda: client.score_request(request), "score", asyncio.Event()),
                10,
            )
