"""The Atari ids (env_server/envs/atari.py): the standard preprocessing, channels-last frames the
Nature CNN takes, clipped training rewards beside the raw game score."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("ale_py", reason="the atari extra (ale-py) is part of the dev install")

from env_server.envs.atari import make_atari
from env_server.registry import make_env


def test_atari_ids_are_registered_and_preprocessed() -> None:
    env = make_env("AtariBreakout-v0", kwargs={})
    assert env.observation_space.shape == (84, 84, 4)
    assert env.observation_space.dtype == np.uint8
    assert env.action_space.n == 4  # NOOP, FIRE, RIGHT, LEFT: the minimal action set
    obs, info = env.reset(seed=3)
    assert obs.shape == (84, 84, 4) and info["score"] == 0.0
    # At reset every stacked frame is the first one; a step shifts the newest in at the end.
    assert all(np.array_equal(obs[..., 0], obs[..., i]) for i in range(4))
    nxt, *_ = env.step(0)
    assert np.array_equal(nxt[..., 2], obs[..., 3])
    env.close()


def test_training_rewards_are_clipped_but_the_score_is_raw() -> None:
    env = make_atari("Breakout", clip_rewards=True)
    env.reset(seed=0)
    rng = np.random.default_rng(0)
    rewards: list[float] = []
    episode_rewards, scores = 0.0, []
    for _ in range(4000):  # a few random episodes: together they break some bricks
        _, reward, terminated, truncated, info = env.step(int(rng.integers(4)))
        rewards.append(float(reward))
        episode_rewards += float(reward)
        if terminated or truncated:
            scores.append((info["score"], episode_rewards))
            episode_rewards = 0.0
            env.reset()
    assert set(rewards) <= {0.0, 1.0}  # Breakout's 1/4/7 points count 1 each for training
    assert scores and sum(clipped for _, clipped in scores) > 0
    assert all(score >= clipped for score, clipped in scores)  # the score keeps the points
    env.close()


def test_same_seed_same_frames() -> None:
    first, second = make_atari("Pong"), make_atari("Pong")
    a, _ = first.reset(seed=7)
    b, _ = second.reset(seed=7)
    for _ in range(20):
        a, *_ = first.step(2)
        b, *_ = second.step(2)
    assert np.array_equal(a, b)
