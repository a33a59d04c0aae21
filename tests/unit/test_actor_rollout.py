"""Fragments built from a scripted run through a real in-process env server.

A scripted env (its observation is [step in episode, episode count], action 1 terminates, a
time limit of 4 truncates) and a scripted policy (actions from a table, V(s) = 10 * s[0] +
s[1]) make every field of the fragment predictable: shapes, terminal and truncated steps,
final observations and values, bootstrap values, episode ids, and the carry-over between
fragments. Two env servers hold the envs, as in a real actor. Stepped double-buffered (two
parts of the envs in flight alternately, sampler/actors/sampling.py), the same action table
gives the same fragments.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import gymnasium as gym
import numpy as np
import pytest
import pytest_asyncio

from common import tensor
from common.behaviour import Decision
from common.fragments import producer_id, producer_of
from env_server.service import EnvServerSettings
from env_server.service import main as serve_envs
from rlfleet.env.v1 import env_pb2, env_pb2_grpc
from sampler.actors.envs import EnvGroup
from sampler.actors.rollout import FragmentMeta, Rollout, fragment_id
from sampler.actors.sampling import DoubleBuffer
from services.membership import PeerView
from services.ports import free_port
from services.registry import ServiceContext
from services.server import channel

SCRIPTED_ID = "RlfleetTest/ActorScripted-v0"
TIME_LIMIT = 4


class ScriptedEnv(gym.Env):
    """obs = [steps taken in this episode, episodes started]; action 1 ends the episode."""

    observation_space = gym.spaces.Box(0.0, 1e6, (2,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def __init__(self) -> None:
        self.steps = 0
        self.episodes = 0

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.steps = 0
        self.episodes += 1
        return self._obs(), {}

    def step(self, action):
        self.steps += 1
        return self._obs(), float(self.steps), bool(action == 1), False, {}

    def _obs(self) -> np.ndarray:
        return np.array([self.steps, self.episodes], np.float32)


class ScriptedPolicy:
    """Actions from a [ticks, N] table; V(s) = 10 * s[0] + s[1]; logp = -0.5."""

    version = 7
    has_values = True

    def __init__(self, table: np.ndarray) -> None:
        self.table = table
        self.tick = 0

    def act(self, obs: np.ndarray) -> Decision:
        actions = self.table[self.tick].astype(np.int64)
        self.tick += 1
        n = len(actions)
        return Decision(actions, actions, np.full(n, -0.5, np.float32), self.values(obs))

    def values(self, obs: np.ndarray) -> np.ndarray:
        return (10 * obs[:, 0] + obs[:, 1]).astype(np.float32)


async def _start_server(name: str) -> tuple[str, ServiceContext, asyncio.Task[None]]:
    ctx = ServiceContext(
        name=name, kind="env_server", settings=EnvServerSettings(), port=free_port()
    )
    task = asyncio.create_task(serve_envs(ctx))
    address = f"127.0.0.1:{ctx.port}"
    async with channel(address) as ch:
        stub = env_pb2_grpc.EnvServiceStub(ch)
        await stub.ListEnvs(env_pb2.ListEnvsRequest(filter="x"), wait_for_ready=True, timeout=30)
    return address, ctx, task


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def servers() -> AsyncIterator[list[str]]:
    if SCRIPTED_ID not in gym.registry:
        gym.register(SCRIPTED_ID, entry_point=ScriptedEnv, max_episode_steps=TIME_LIMIT)
    started = [await _start_server(f"env-rollout-{i}") for i in range(2)]
    yield [address for address, _, _ in started]
    for _, ctx, task in started:
        ctx.stop_event.set()
        await asyncio.wait_for(task, 30)


def _group(servers: list[str], num_envs: int, **kwargs: Any) -> EnvGroup:
    """The scripted env's columns over fixed server addresses."""
    peers = PeerView(servers, kind="env_server", resolve=str)
    return EnvGroup(peers, num_envs, SCRIPTED_ID, **kwargs)


async def _run(envs: EnvGroup, rollout: Rollout, policy: ScriptedPolicy, ticks: int) -> None:
    for _ in range(ticks):
        decision = policy.act(rollout.current_obs)
        out = rollout.record(decision)
        events = await envs.step(decision.env_actions, rollout.current_obs, out)
        rollout.finish(events)


def _decode(fragment, name: str) -> np.ndarray:
    field = getattr(fragment, name)
    return tensor.decode_tree(field) if hasattr(field, "tensor") else tensor.decode(field)


@pytest.mark.asyncio(loop_scope="session")
async def test_fragment_from_scripted_run(servers: list[str]) -> None:
    t_steps, n = 6, 3
    # Only the time limit (4 steps) ends env 0's episodes; env 1 terminates at tick 1, env 2
    # at ticks 0 and 2; all other actions are 0.
    table = np.zeros((t_steps * 2, n), np.int64)
    table[1, 1] = 1
    table[0, 2] = table[2, 2] = 1
    envs = _group(servers, 3, seed=0)
    first = await envs.open()
    try:
        assert first is not None
        rollout = Rollout(t_steps, n, envs.observation_space, envs.action_space, has_values=True)
        rollout.begin(first)
        policy = ScriptedPolicy(table)
        await _run(envs, rollout, policy, t_steps)
        assert rollout.full
        meta = FragmentMeta("run-a", "actor-0", "inc1", SCRIPTED_ID, envs.addresses, "s")
        frag = rollout.build(policy, meta)
        next_first = rollout.obs[t_steps].copy()
        rollout.restart()
        await _run(envs, rollout, policy, t_steps)
        frag2 = rollout.build(policy, meta)
    finally:
        await envs.close()

    assert frag.fragment_id == fragment_id("run-a", "actor-0", "inc1", 0) == "run-a/actor-0/inc1/0"
    assert (frag.sequence, frag2.sequence, frag2.fragment_id) == (0, 1, "run-a/actor-0/inc1/1")
    # The learner reports what it took per producer, which it reads off the id.
    producer = producer_id("run-a", "actor-0", "inc1")
    assert producer_of(frag2.fragment_id, frag2.sequence) == producer == "run-a/actor-0/inc1"
    assert producer_of(frag2.fragment_id, 7) is None  # an id not of the form <producer>/<seq>
    assert producer_of("7", 7) is None
    assert (frag.num_steps, frag.num_envs, frag.policy_version) == (t_steps, n, 7)
    assert frag.env_address == ",".join(servers)

    obs = _decode(frag, "observations")
    actions = _decode(frag, "actions")
    rewards = _decode(frag, "rewards")
    terminated = _decode(frag, "terminated")
    truncated = _decode(frag, "truncated")
    values = _decode(frag, "values")
    next_obs = _decode(frag, "next_observations")
    assert obs.shape == (t_steps, n, 2) and obs.dtype == np.float32
    assert actions.shape == (t_steps, n) and actions.dtype == np.int64
    for name in ("logprobs", "values", "rewards"):
        assert _decode(frag, name).shape == (t_steps, n)
        assert _decode(frag, name).dtype == np.float32
    assert terminated.dtype == truncated.dtype == np.bool_
    assert next_obs.shape == (n, 2)
    np.testing.assert_array_equal(actions, table[:t_steps])
    np.testing.assert_array_equal(_decode(frag, "logprobs"), -0.5)

    # Env 0: steps 1..4, truncated at tick 3 (its 4th step), then a new episode.
    np.testing.assert_array_equal(obs[:, 0, 0], [0, 1, 2, 3, 0, 1])
    np.testing.assert_array_equal(rewards[:, 0], [1, 2, 3, 4, 1, 2])
    np.testing.assert_array_equal(truncated[:, 0], [0, 0, 0, 1, 0, 0])
    # Env 1: terminated at tick 1, then truncated 4 steps later (tick 5). Env 2: terminated at
    # ticks 0 and 2. Same-step autoreset: the row after an end holds the new episode's start.
    np.testing.assert_array_equal(terminated[:, 1], [0, 1, 0, 0, 0, 0])
    np.testing.assert_array_equal(truncated[:, 1], [0, 0, 0, 0, 0, 1])
    np.testing.assert_array_equal(terminated[:, 2], [1, 0, 1, 0, 0, 0])
    np.testing.assert_array_equal(obs[:, 2], [[0, 1], [0, 2], [1, 2], [0, 3], [1, 3], [2, 3]])
    assert not terminated[:, 0].any() and not truncated[:, 2].any()
    np.testing.assert_array_equal(next_obs, [[2, 2], [0, 3], [3, 3]])
    np.testing.assert_array_equal(_decode(frag2, "observations")[0], next_first)

    # Values and bootstrap values are V(s) under the behaviour policy.
    np.testing.assert_array_equal(values, 10 * obs[..., 0] + obs[..., 1])
    np.testing.assert_array_equal(_decode(frag, "bootstrap_values"), [22, 3, 33])

    # Truncated steps as flat indices t * N + n: env 0 at tick 3, env 1 at tick 5; their last
    # observations (4 steps into episode 1 and 2) and V of those.
    np.testing.assert_array_equal(_decode(frag, "final_indices"), [3 * n + 0, 5 * n + 1])
    np.testing.assert_array_equal(_decode(frag, "final_observations"), [[4, 1], [4, 2]])
    np.testing.assert_array_equal(_decode(frag, "final_values"), [41, 42])
    # Fragment 2 (ticks 6-11, no terminations): every episode runs into the time limit. In
    # increasing flat order: env 2 at ticks 6 and 10, env 0 at 7 and 11, env 1 at 9.
    np.testing.assert_array_equal(
        _decode(frag2, "final_indices"), [0 * n + 2, 1 * n + 0, 3 * n + 1, 4 * n + 2, 5 * n + 0]
    )
    np.testing.assert_array_equal(_decode(frag2, "final_observations")[:, 0], [4] * 5)
    np.testing.assert_array_equal(
        _decode(frag2, "truncated"),
        np.isin(np.arange(t_steps * n), [2, 3, 10, 14, 15]).reshape(t_steps, n),
    )

    # Episode ids: distinct across envs, constant within an episode, next id after each end.
    ids = np.concatenate([_decode(frag, "episode_ids"), _decode(frag2, "episode_ids")])
    done = np.concatenate(
        [terminated | truncated, _decode(frag2, "terminated") | _decode(frag2, "truncated")]
    )
    np.testing.assert_array_equal(ids[0], [0, 1, 2])
    for env in range(n):
        steps = np.diff(ids[:, env])
        assert (steps >= 0).all()
        np.testing.assert_array_equal(steps > 0, done[:-1, env])
    per_env = [set(ids[:, env].tolist()) for env in range(n)]
    assert not (per_env[0] & per_env[1]) and not (per_env[1] & per_env[2])


@pytest.mark.asyncio(loop_scope="session")
async def test_fragment_without_critic_has_no_values(servers: list[str]) -> None:
    from common.behaviour import RandomBehaviour

    envs = _group(servers[:1], 4, seed=1)
    first = await envs.open()
    try:
        policy = RandomBehaviour(envs.action_space, 4, seed=3)
        rollout = Rollout(8, 4, envs.observation_space, envs.action_space, has_values=False)
        rollout.begin(first)
        for _ in range(8):
            decision = policy.act(rollout.current_obs)
            out = rollout.record(decision)
            rollout.finish(await envs.step(decision.env_actions, rollout.current_obs, out))
        frag = rollout.build(policy, FragmentMeta("r", "a", "i", SCRIPTED_ID, servers[0], "s"))
    finally:
        await envs.close()
    for name in ("values", "bootstrap_values", "final_values"):
        assert not frag.HasField(name)
    np.testing.assert_allclose(tensor.decode(frag.logprobs), np.log(0.5))
    assert frag.policy_version == 0


def test_build_refuses_a_partial_fragment() -> None:
    space = gym.spaces.Box(0.0, 1.0, (2,), np.float32)
    rollout = Rollout(4, 2, space, gym.spaces.Discrete(2), has_values=False)
    with pytest.raises(RuntimeError, match="0 of 4"):
        rollout.build(ScriptedPolicy(np.zeros((1, 2))), FragmentMeta("r", "a", "i", "e", "x", "s"))


async def _account(events, steps: int) -> bool:
    return False


@pytest.mark.parametrize("colocated", ["auto", "off"])
@pytest.mark.asyncio(loop_scope="session")
async def test_double_buffered_fragments_equal_lock_step_ones(
    servers: list[str], colocated: str
) -> None:
    # The scripted env is a function of its column's actions only, so the same action table
    # must give the same fragments (column by column) whether the columns step in lock step or
    # as two parts in flight alternately; only the numbering of episode ids may differ.
    t_steps, n = 6, 4
    rng = np.random.default_rng(0)
    table = (rng.random((t_steps * 2, n)) < 0.3).astype(np.int64)
    frags = {}
    for double in (False, True):
        envs = _group(servers, 4, colocated=colocated, double_buffer=double)
        first = await envs.open()
        assert first is not None
        try:
            space = (envs.observation_space, envs.action_space)
            rollout = Rollout(t_steps, n, *space, has_values=True, parts=envs.parts)
            rollout.begin(first)
            policy = ScriptedPolicy(table)
            meta = FragmentMeta("r", "a", "i", SCRIPTED_ID, envs.addresses, "s")
            if double:
                assert envs.parts == [slice(0, 2), slice(2, 4)]
                assert [link.address for link in envs.links] == servers * 2
                halves = [ScriptedPolicy(table[:, cols]) for cols in envs.parts]
                sampler = DoubleBuffer(halves, rollout, envs)
            got = []
            for _ in range(2):
                if double:
                    await sampler.fill(_account)
                else:
                    await _run(envs, rollout, policy, t_steps)
                got.append(rollout.build(policy, meta))
                rollout.restart()
            frags[double] = got
        finally:
            await envs.close()

    for lock, double in zip(frags[False], frags[True], strict=True):
        assert (double.num_steps, double.num_envs, double.sequence) == (
            lock.num_steps,
            lock.num_envs,
            lock.sequence,
        )
        for name in ("observations", "actions", "logprobs", "rewards", "terminated", "truncated"):
            np.testing.assert_array_equal(_decode(double, name), _decode(lock, name), name)
        for name in ("values", "next_observations", "bootstrap_values", "final_indices"):
            np.testing.assert_array_equal(_decode(double, name), _decode(lock, name), name)
        for name in ("final_observations", "final_values"):
            np.testing.assert_array_equal(_decode(double, name), _decode(lock, name), name)
    # Episode ids: each column's increase exactly after its ends, and no id in two columns.
    ids = np.concatenate([_decode(f, "episode_ids") for f in frags[True]])
    done = np.concatenate([_decode(f, "terminated") | _decode(f, "truncated") for f in frags[True]])
    np.testing.assert_array_equal(ids[0], np.arange(n))
    for env in range(n):
        np.testing.assert_array_equal(np.diff(ids[:, env]) > 0, done[:-1, env])
    per_env = [set(ids[:, env].tolist()) for env in range(n)]
    assert sum(len(s) for s in per_env) == len(set().union(*per_env))


@pytest.mark.asyncio(loop_scope="session")
async def test_double_buffer_stops_after_the_step_in_flight(servers: list[str]) -> None:
    # Told to stop after part 0's 3rd step, the sampler still lands part 1's step in flight:
    # both parts end on the same row, as a lock-step tick would.
    envs = _group(servers[:1], 4, double_buffer=True)
    first = await envs.open()
    try:
        rollout = Rollout(8, 4, envs.observation_space, envs.action_space, has_values=True,
                          parts=envs.parts)  # fmt: skip
        rollout.begin(first)
        table = np.zeros((8, 4), np.int64)
        calls: list[int] = []

        async def account(events, steps: int) -> bool:
            calls.append(steps)
            return len(calls) == 5  # part 0's 3rd step (0, 1, 0, 1, 0)

        halves = [ScriptedPolicy(table[:, cols]) for cols in envs.parts]
        await DoubleBuffer(halves, rollout, envs).fill(account)
    finally:
        await envs.close()
    assert calls == [2] * 6
    assert not rollout.full and [rollout.part_full(p) for p in (0, 1)] == [False, False]
    assert rollout.t == 3
    np.testing.assert_array_equal(rollout.obs[3, :, 0], [3, 3, 3, 3])
