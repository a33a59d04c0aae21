"""The game actor in `learner` mode against a real WeightService and a real bus.

The learner here is its weight side only (learner.weights: the store, the WeightService on a
gRPC socket, announcements on NATS), so the test controls exactly which weights each version
holds. The actor must wait for the first version, tag every fragment with the version that
produced it, swap to an announced version only between fragments, and report behaviour values
and log-probabilities that the learner's own module reproduces.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import gymnasium as gym
import numpy as np
import pytest
import pytest_asyncio
import torch

from common import tensor
from common.fragments import producer_of
from common.policies import PolicyConfig, build_policy
from env_server.service import EnvServerSettings
from env_server.service import main as serve_envs
from learner.weights import SERVICE_NAME, WeightServicer, WeightStore, add_weight_service, announce
from rlfleet.bus.v1 import trajectory_pb2
from sampler.actors.actor import GameActor
from sampler.actors.settings import GameActorSettings
from services.bus import Bus, stream_name, traj_subject
from services.ports import free_port
from services.registry import ServiceContext
from services.server import GrpcServer, wait_for_health

pytestmark = [
    pytest.mark.slow,  # DeepSpeed learner services: not in `make test-fast`
    pytest.mark.timeout(120),
    pytest.mark.asyncio(loop_scope="session"),
]

HIDDEN = (16, 16)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def env_server() -> AsyncIterator[str]:
    ctx = ServiceContext(
        name="env-learner-test", kind="env_server", settings=EnvServerSettings(), port=free_port()
    )
    task = asyncio.create_task(serve_envs(ctx))
    address = f"127.0.0.1:{ctx.port}"
    await asyncio.to_thread(wait_for_health, address, 30)
    yield address
    ctx.stop_event.set()
    await asyncio.wait_for(task, 30)


class StandInLearner:
    """A WeightService with versions the test publishes, announced on the bus."""

    def __init__(self, run: str, bus: Bus) -> None:
        self.run, self.bus = run, bus
        self.store = WeightStore(run, keep=4)
        self.server = GrpcServer("learner-test", port=free_port())
        self.server.add_service(add_weight_service, WeightServicer(self.store), SERVICE_NAME)
        self.nets: dict[int, Any] = {}

    async def start(self) -> str:
        await self.server.start()
        self.server.set_serving()
        return self.server.address

    async def publish(self, critic_bias: float, taken: dict[str, int] | None = None) -> int:
        """A new version: a fresh network whose critic output is shifted by `critic_bias`,
        announced with the `taken` sequences per producer (WeightsPublished.taken_sequences)."""
        env = gym.make("CartPole-v1")
        config = PolicyConfig(hidden_sizes=HIDDEN)
        net = build_policy(env.observation_space, env.action_space, config)
        with torch.no_grad():
            net.critic[-1].bias.fill_(critic_bias)
        manifest = await asyncio.to_thread(self.store.publish, net.state_dict())
        self.nets[manifest.version] = net
        await announce(self.bus, self.run, manifest, self.server.address, taken_sequences=taken)
        return manifest.version


def _arr(msg: Any) -> np.ndarray:
    return tensor.decode_tree(msg) if hasattr(msg, "tensor") else tensor.decode(msg)


@contextlib.asynccontextmanager
async def running_actor(
    bus: Bus, run: str, nats_url: str, env_server: str, learner: str, **knobs: Any
) -> AsyncIterator[tuple[asyncio.Task[None], list[trajectory_pb2.RolloutFragment]]]:
    """A learner-mode actor (`knobs`: more GameActorSettings) and the fragments it publishes,
    pulled and acked as they come; the actor is stopped on exit."""
    settings = GameActorSettings(
        env_servers=["env"],
        env_id="CartPole-v1",
        policy="learner",
        learner="learner",
        policy_config={"hidden_sizes": HIDDEN},
        stats_interval_s=60,
        **knobs,
    )
    ctx = ServiceContext(
        name="actor-0",
        kind="game_actor",
        settings=settings,
        run_name=run,
        nats_url=nats_url,
        endpoints={"env": env_server, "learner": learner},
    )
    actor = asyncio.create_task(GameActor(ctx, settings).run())
    frags: list[trajectory_pb2.RolloutFragment] = []
    stop_pull = asyncio.Event()

    async def consume() -> None:
        async for d in bus.pull(
            stream_name(run),
            "learner",
            traj_subject(run),
            trajectory_pb2.RolloutFragment,
            timeout_s=0.2,
            stop_event=stop_pull,
        ):
            frags.append(d.message)
            await d.ack()

    consumer = asyncio.create_task(consume())
    try:
        yield actor, frags
    finally:
        ctx.stop_event.set()
        await asyncio.wait_for(actor, 30)
        stop_pull.set()
        await asyncio.wait_for(consumer, 10)


@pytest.mark.parametrize("double_buffer", ["off", "on"])  # on: two halves in flight
async def test_actor_follows_the_learners_versions(
    nats_url: str, env_server: str, double_buffer: str
) -> None:
    run, t_steps, n = f"itest-learn-{uuid.uuid4().hex[:8]}", 16, 4
    async with Bus.connect(nats_url, name="test-learner") as bus:
        await bus.ensure_stream(stream_name(run), [traj_subject(run)])
        learner = StandInLearner(run, bus)
        address = await learner.start()
        knobs = {"num_envs": n, "rollout_length": t_steps, "double_buffer": double_buffer}
        try:
            async with running_actor(bus, run, nats_url, env_server, address, **knobs) as (
                actor,
                frags,
            ):
                await asyncio.sleep(1.0)  # the learner has no version yet: the actor must wait
                assert not frags and not actor.done()
                await learner.publish(critic_bias=0.0)
                await _until(lambda: len(frags) >= 3)
                await learner.publish(critic_bias=100.0)
                await _until(lambda: any(f.policy_version == 1 for f in frags) and len(frags) >= 8)
        finally:
            await learner.server.stop(0)

    versions = [f.policy_version for f in frags]
    assert versions[0] == 0 and versions == sorted(versions) and versions[-1] == 1
    assert [f.sequence for f in frags] == list(range(len(frags)))
    for f in frags:
        net = learner.nets[f.policy_version]
        obs = torch.from_numpy(_arr(f.observations).reshape(t_steps * n, 4).copy())
        actions = torch.from_numpy(_arr(f.actions).reshape(-1).copy())
        with torch.no_grad():
            _, logp, _, value = net.evaluate(obs, actions)
            bootstrap = net.value(torch.from_numpy(_arr(f.next_observations).copy()))
        # Every step of a fragment comes from the version it is tagged with.
        np.testing.assert_allclose(_arr(f.values).reshape(-1), value.numpy(), atol=1e-4)
        np.testing.assert_allclose(_arr(f.logprobs).reshape(-1), logp.numpy(), atol=1e-4)
        np.testing.assert_allclose(_arr(f.bootstrap_values), bootstrap.numpy(), atol=1e-4)


async def test_actor_keeps_its_outstanding_fragments_bounded_by_what_the_learner_took(
    nats_url: str, env_server: str
) -> None:
    """Flow control: one fragment per version and one version ahead allow 2 fragments built
    but not taken. Before the learner reports taking any, the credit counts versions (2
    fragments on v0); then it follows the reported sequences, whatever the versions say."""
    run = f"itest-pace-{uuid.uuid4().hex[:8]}"
    async with Bus.connect(nats_url, name="test-learner") as bus:
        await bus.ensure_stream(stream_name(run), [traj_subject(run)])
        learner = StandInLearner(run, bus)
        address = await learner.start()
        knobs = {"num_envs": 2, "rollout_length": 4, "fragments_per_version": 1}
        try:
            async with running_actor(bus, run, nats_url, env_server, address, **knobs) as (
                _,
                frags,
            ):

                async def settled(count: int) -> None:
                    await _until(lambda: len(frags) >= count)
                    await asyncio.sleep(1.0)  # and no more come
                    assert len(frags) == count, [f.policy_version for f in frags]

                await learner.publish(critic_bias=0.0)
                await paced_on_taken_sequences(learner, frags, settled)
        finally:
            await learner.server.stop(0)
    assert [f.policy_version for f in frags] == [0, 0, 1, 2, 2]


async def paced_on_taken_sequences(
    learner: StandInLearner,
    frags: list[trajectory_pb2.RolloutFragment],
    settled: Callable[[int], Awaitable[None]],
) -> None:
    """The flow-control steps every producer passes (one fragment per version, one version
    ahead: 2 built but not taken), from v0 published; `settled(n)`: n fragments and no more."""
    await settled(2)  # v0 and one version ahead on it
    producer = producer_of(frags[0].fragment_id, frags[0].sequence)
    assert producer is not None
    # Version 1 took fragment 0: one outstanding, so one more.
    await learner.publish(critic_bias=1.0, taken={producer: 0})
    await settled(3)
    # Version 2 took fragments 1 and 2: none outstanding, two more. (A credit counted in
    # versions would allow one: 4 fragments by v2.)
    await learner.publish(critic_bias=2.0, taken={producer: 2})
    await settled(5)


async def _until(condition: Any, timeout_s: float = 30.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.05)
