"""Atari 2600 games through ale-py (the `atari` extra; the wheel ships the ROMs), with the
standard DQN/PPO preprocessing, as ``Atari<Game>-v0`` ids (``AtariBreakout-v0``,
``AtariPong-v0``, ...).

The pipeline is gymnasium's own wrappers in the order of Mnih et al. (2015) and CleanRL's
``ppo_atari.py``: the ALE env without its built-in frame skip and without sticky actions, then
``AtariPreprocessing`` (up to 30 no-op actions after reset, 4 frames per step max-pooled over the
last two, 84x84 grayscale), FIRE pressed at reset for games that need it to start, rewards
clipped to their sign for training, and the last 4 frames stacked. The observation is uint8
``[84, 84, 4]``, channels last, which is what the learner's Nature-CNN trunk takes.

Clipping changes what the return means (Breakout's 1/4/7 points per brick count 1 each), so the
raw game score is kept: ``info["score"]`` is the unclipped score of the episode so far, which
``rlfleet play`` reports. ``clip_rewards=False`` trains on raw points instead.
"""

from __future__ import annotations

from typing import Any, SupportsFloat

import gymnasium
import numpy as np
from gymnasium import spaces

__all__ = ["ATARI_GAMES", "AtariEnv", "make_atari"]

# The games registered as Atari<Game>-v0 when ale-py is installed (any other ALE game works
# through make_atari(game=...) or ALE's own ids).
ATARI_GAMES = ("Breakout", "Pong", "SpaceInvaders", "Seaquest", "BeamRider", "Qbert")


class AtariEnv(gymnasium.Wrapper[np.ndarray, int, np.ndarray, int]):
    """FIRE at reset, sign-clipped rewards with the raw score in ``info["score"]``, and the
    last ``frame_stack`` preprocessed frames as ``[84, 84, frame_stack]``."""

    def __init__(self, env: gymnasium.Env[Any, Any], frame_stack: int, clip_rewards: bool):
        super().__init__(env)
        meanings = env.unwrapped.get_action_meanings()  # type: ignore[attr-defined]
        self._fire = meanings.index("FIRE") if "FIRE" in meanings else None
        self._clip = clip_rewards
        self._frames = np.zeros((84, 84, frame_stack), dtype=np.uint8)
        self._score = 0.0
        self.observation_space = spaces.Box(0, 255, self._frames.shape, np.uint8)

    def _push(self, frame: np.ndarray) -> np.ndarray:
        self._frames[..., :-1] = self._frames[..., 1:]
        self._frames[..., -1] = frame
        return self._frames.copy()

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        frame, info = self.env.reset(seed=seed, options=options)
        if self._fire is not None:  # Breakout and others wait for FIRE before play starts
            frame, _, terminated, truncated, info = self.env.step(self._fire)
            if terminated or truncated:
                frame, info = self.env.reset()
        self._score = 0.0
        self._frames[...] = frame[..., None]
        return self._frames.copy(), {**info, "score": 0.0}

    def step(self, action: int) -> tuple[np.ndarray, SupportsFloat, bool, bool, dict[str, Any]]:
        frame, reward, terminated, truncated, info = self.env.step(action)
        self._score += float(reward)
        if self._clip:
            reward = float(np.sign(float(reward)))
        return self._push(frame), reward, terminated, truncated, {**info, "score": self._score}


def make_atari(
    game: str = "Breakout",
    *,
    frame_stack: int = 4,
    noop_max: int = 30,
    clip_rewards: bool = True,
    max_episode_steps: int = 27_000,
    render_mode: str | None = None,
) -> gymnasium.Env[np.ndarray, int]:
    """One preprocessed Atari game (see the module docstring). ``max_episode_steps`` counts
    agent steps (4 frames each): 27k is the usual 108k-frame cap."""
    import ale_py

    gymnasium.register_envs(ale_py)
    env = gymnasium.make(
        f"ALE/{game}-v5",
        frameskip=1,  # AtariPreprocessing skips (and max-pools) instead
        repeat_action_probability=0.0,
        full_action_space=False,
        max_episode_steps=max_episode_steps * 4,
        render_mode=render_mode,
    )
    env = gymnasium.wrappers.AtariPreprocessing(
        env, noop_max=noop_max, frame_skip=4, screen_size=84, grayscale_obs=True
    )
    return AtariEnv(env, frame_stack, clip_rewards)
