"""Game links pace on what the learner took (env_server/game_link/links.py `pace`), as actors do.

An env server with game links in this process follows a stand-in learner's versions (a real
WeightService and real announcements on a real NATS). One fragment per version and one version
ahead allow 2 of a link's fragments built but not taken: before the learner reports taking any,
the credit counts versions; then it follows the reported sequences, whatever the versions say.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from typing import Any

import gymnasium as gym
import numpy as np
import pytest

from clients.game_link import AsyncGameLink
from services.bus import Bus, stream_name, traj_subject
from tests.contract.test_game_link import Server
from tests.integration.test_actor_learner import HIDDEN, StandInLearner, paced_on_taken_sequences

pytestmark = [pytest.mark.timeout(120), pytest.mark.asyncio(loop_scope="session")]

AGENTS = 2
T = 3  # ticks per fragment


async def _play(link: AsyncGameLink) -> None:
    """AGENTS CartPoles in lock step with the link until cancelled."""
    envs = [gym.make("CartPole-v1") for _ in range(AGENTS)]
    episodes = np.arange(AGENTS, dtype=np.int64)
    obs = np.stack([env.reset(seed=k)[0] for k, env in enumerate(envs)])
    rewards = np.zeros(AGENTS, np.float32)
    terminated, truncated = np.zeros(AGENTS, bool), np.zeros(AGENTS, bool)
    while True:
        actions = await link.act(obs, rewards, terminated, truncated, episodes)
        for k, env in enumerate(envs):
            if terminated[k] or truncated[k]:
                obs[k] = env.reset()[0]
                rewards[k], terminated[k], truncated[k] = 0.0, False, False
                episodes[k] += AGENTS
                continue
            obs[k], rewards[k], terminated[k], truncated[k], _ = env.step(int(actions[k]))


async def test_a_link_keeps_its_outstanding_fragments_bounded_by_what_the_learner_took(
    nats_url: str,
) -> None:
    run = f"gl-pace-{uuid.uuid4().hex[:8]}"
    async with Bus.connect(nats_url, name="gl-pace-learner") as bus:
        await bus.ensure_stream(stream_name(run), [traj_subject(run)])
        learner = StandInLearner(run, bus)
        server = Server(
            nats_url,
            policy="learner",
            learner="learner",
            policy_config={"hidden_sizes": HIDDEN},
            rollout_length=T,
            fragments_per_version=1,
            stats_interval_s=60,
        )
        server.run = server.ctx.run_name = run
        server.ctx.endpoints = {"learner": await learner.start()}
        await server.start()
        playing: asyncio.Task[Any] | None = None
        try:
            await learner.publish(critic_bias=0.0)
            link = await AsyncGameLink.open(
                server.address,
                game="pace",
                env_id="CartPole-v1",
                observation_space=gym.spaces.Box(-np.inf, np.inf, (4,), np.float32),
                action_space=gym.spaces.Discrete(2),
                num_agents=AGENTS,
            )
            playing = asyncio.create_task(_play(link))
            frags = server.fragments[link.link.link_id]

            async def settled(count: int) -> None:
                await server.wait_fragments(link.link.link_id, count, timeout_s=30)
                await asyncio.sleep(1.0)  # and no more come
                assert len(frags) == count, [f.policy_version for f in frags]

            await paced_on_taken_sequences(learner, frags, settled)
        finally:
            await server.stop()  # ends the link's stream: the game's pending act fails
            if playing is not None:
                playing.cancel()
                with contextlib.suppress(BaseException):
                    await playing
            await learner.server.stop(0)
    # A fragment's version is its first decision's, made at the tick that completed the
    # previous fragment (before the hold): each one is a version behind the actor's.
    assert [f.policy_version for f in frags][:5] == [0, 0, 0, 1, 2]
