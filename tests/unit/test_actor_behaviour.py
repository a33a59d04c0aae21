"""Behaviour policies and settings of the game actor.

The actor samples discrete actions from the network's logits itself (not through
torch.distributions), so its log-probabilities must equal what the learner recomputes with
`ActorCritic.evaluate` for the same actions; the random policy's must be the exact uniform ones.
"""

from __future__ import annotations

import math

import numpy as np
import pydantic
import pytest
import torch
from gymnasium import spaces

from common.behaviour import RandomBehaviour, TorchBehaviour, action_layout
from common.policies import PolicyConfig, build_policy
from sampler.actors.envs import EnvGroup
from sampler.actors.settings import GameActorSettings
from services.errors import InvalidArgument
from services.membership import PeerView

OBS = spaces.Box(-5.0, 5.0, (4,), np.float32)


def _obs(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(n, 4)).astype(np.float32)


@pytest.mark.parametrize(
    ("space", "outcomes"),
    [
        (spaces.Discrete(3, start=-1), 3),
        (spaces.MultiDiscrete([2, 5], start=[1, 0]), 10),
        (spaces.MultiBinary(3), 8),
    ],
)
def test_random_integer_actions_are_uniform_and_seeded(space: spaces.Space, outcomes: int) -> None:
    n = 4000
    first = RandomBehaviour(space, n, seed=5).act(_obs(1))
    again = RandomBehaviour(space, n, seed=5).act(_obs(1))
    np.testing.assert_array_equal(first.actions, again.actions)
    assert first.actions.shape == (n, *space.shape)
    assert first.env_actions.dtype == space.dtype
    assert all(space.contains(a) for a in first.env_actions[:50])
    np.testing.assert_allclose(first.logprobs, -math.log(outcomes), rtol=1e-6)
    assert first.values is None
    # Every value occurs about equally often.
    _, counts = np.unique(first.actions.reshape(n, -1)[:, 0], return_counts=True)
    assert counts.min() > 0.7 * counts.max()


def test_random_box_actions_and_logprobs() -> None:
    bounded = spaces.Box(np.float32([-1.0, 0.0]), np.float32([1.0, 4.0]))
    d = RandomBehaviour(bounded, 1000, seed=0).act(_obs(1))
    assert d.actions.dtype == np.float32 and d.actions.shape == (1000, 2)
    assert (d.actions >= bounded.low).all() and (d.actions <= bounded.high).all()
    np.testing.assert_allclose(d.logprobs, -math.log(2.0 * 4.0), rtol=1e-6)

    mixed = spaces.Box(np.float32([-np.inf, 0.0, -1.0]), np.float32([np.inf, np.inf, 1.0]))
    d = RandomBehaviour(mixed, 500, seed=1).act(_obs(1))
    z, e = d.actions[:, 0].astype(np.float64), d.actions[:, 1].astype(np.float64)
    expected = -0.5 * z**2 - 0.5 * math.log(2 * math.pi) - e - math.log(2.0)
    np.testing.assert_allclose(d.logprobs, expected, rtol=1e-4, atol=1e-4)
    assert (d.actions[:, 1] >= 0).all()


@pytest.mark.parametrize("space", [spaces.Discrete(3, start=2), spaces.MultiDiscrete([2, 4])])
def test_torch_logprobs_match_the_learners_evaluate(space: spaces.Space) -> None:
    policy = TorchBehaviour(OBS, space, PolicyConfig(hidden_sizes=(16,)), seed=0)
    # Sharper logits than the 0.01-gain init, so the check covers uneven distributions.
    with torch.no_grad():
        for p in policy.net.actor.parameters():
            p.mul_(100.0)
    obs = _obs(64)
    d = policy.act(obs)
    assert d.actions.dtype == np.int64 and d.actions.shape == (64, *space.shape)
    assert all(space.contains(a) for a in d.env_actions)
    with torch.no_grad():
        _, logp, _, value = policy.net.evaluate(torch.from_numpy(obs), torch.from_numpy(d.actions))
    np.testing.assert_allclose(d.logprobs, logp.numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(d.values, value.numpy(), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(policy.values(obs), value.numpy(), rtol=1e-6, atol=1e-6)


def test_torch_samples_follow_the_policy_distribution() -> None:
    space = spaces.Discrete(3)
    policy = TorchBehaviour(OBS, space, PolicyConfig(hidden_sizes=(8,)), seed=1)
    with torch.no_grad():
        for p in policy.net.actor.parameters():
            p.mul_(50.0)
    obs = np.repeat(_obs(1, seed=3), 20000, axis=0)
    d = policy.act(obs)
    frequencies = np.bincount(d.actions, minlength=3) / len(d.actions)
    expected = np.zeros(3)
    expected[d.actions] = np.exp(d.logprobs)
    assert expected.max() < 0.9  # not a near-deterministic policy
    np.testing.assert_allclose(frequencies, expected, atol=0.015)


def test_torch_box_actions_and_weight_loading() -> None:
    box = spaces.Box(-1.0, 1.0, (2,), np.float32)
    policy = TorchBehaviour(OBS, box, PolicyConfig(hidden_sizes=(8,)), seed=0)
    d = policy.act(_obs(5))
    assert d.actions.shape == (5, 2) and d.actions.dtype == np.float32
    assert (np.abs(d.env_actions) <= 1.0).all()

    learner = build_policy(OBS, box, PolicyConfig(hidden_sizes=(8,)))
    state = {k: v.clone() for k, v in learner.state_dict().items()}
    policy.load(state, version=3)
    assert policy.version == 3
    np.testing.assert_allclose(
        policy.values(_obs(5)), learner.value(torch.from_numpy(_obs(5))).detach().numpy()
    )
    with pytest.raises(InvalidArgument, match="missing"):
        policy.load({"critic.0.weight": state["critic.0.weight"]}, version=4)


def test_action_layout_refuses_structured_spaces() -> None:
    assert action_layout(spaces.Discrete(2)) == ((), np.dtype(np.int64))
    with pytest.raises(InvalidArgument, match="action space"):
        action_layout(spaces.Dict({"a": spaces.Discrete(2)}))


def test_settings() -> None:
    base = {"env_servers": ["env-a", "env-b"], "env_id": "CartPole-v1"}
    settings = GameActorSettings(**base, num_envs=5)
    # Five envs over two servers: contiguous, the first larger, seeded by column.
    peers = PeerView(["a:1", "b:1"], kind="env_server", resolve=str)
    group = EnvGroup(peers, settings.num_envs, settings.env_id, seed=10)
    links = group._layout(0, ["a:1", "b:1"])
    assert [(k.address, k.start, k.stop, k.seed) for k in links] == [
        ("a:1", 0, 3, 10),
        ("b:1", 3, 5, 13),
    ]
    # More servers than envs: one env each on the least loaded.
    assert len(EnvGroup(peers, 1, "CartPole-v1")._layout(0, ["a:1", "b:1"])) == 1
    halves = EnvGroup(peers, 5, "CartPole-v1", double_buffer=True)
    assert [p.stop - p.start for p in halves.parts] == [3, 2]
    assert settings.publishes is False  # random policy: fragments only when asked
    assert GameActorSettings(**base, publish_fragments=True).publishes
    seeds = {GameActorSettings(**base, num_envs=8, actor_index=i).env_seed() for i in range(4)}
    assert seeds == {0, 8, 16, 24}  # actor i's envs: seeds [8 i, 8 i + 8), never shared
    learner = GameActorSettings(**base, policy="learner", learner="learner")
    assert learner.publishes
    with pytest.raises(pydantic.ValidationError, match="needs `learner`"):
        GameActorSettings(**base, policy="learner")
    with pytest.raises(pydantic.ValidationError, match="fewer than the 2 env servers"):
        GameActorSettings(**base, num_envs=1)
    with pytest.raises(pydantic.ValidationError, match="rollout_lenght"):
        GameActorSettings(**base, rollout_lenght=5)
