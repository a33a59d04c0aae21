"""Snake-v0's rules (growth, collisions, food placement, truncation), its observations, and that
it is a listed, checkable gymnasium env (`rlfleet envs`, `check_env`, rgb_array rendering)."""

from __future__ import annotations

from collections import deque
from pathlib import Path

import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env

from env_server.envs.snake import SnakeEnv
from env_server.registry import list_local_envs, make_env
from launch.cli import main as rlfleet
from services.config import load_run_config

STRAIGHT, RIGHT, LEFT = 0, 1, 2
UP, EAST, DOWN, WEST = 0, 1, 2, 3


def _placed(
    env: SnakeEnv, body: list[tuple[int, int]], heading: int, food: tuple[int, int]
) -> None:
    """Put the game in a known state (head first)."""
    env.body = deque(body)
    env.heading = heading
    env.food = food


def _env(**kwargs: object) -> SnakeEnv:
    env = SnakeEnv(**kwargs)  # type: ignore[arg-type]
    env.reset(seed=0)
    return env


def test_eating_grows_by_one_scores_and_moves_the_food() -> None:
    env = _env()
    _placed(env, [(5, 5), (5, 4), (5, 3)], EAST, food=(5, 6))
    _, reward, terminated, truncated, info = env.step(STRAIGHT)
    assert (reward, terminated, truncated) == (1.0, False, False)
    assert list(env.body) == [(5, 6), (5, 5), (5, 4), (5, 3)]
    assert info == {"score": 1, "length": 4}
    assert env.food is not None and env.food not in env.body
    _, reward, *_ = env.step(RIGHT)  # now heading down; no food there: same length
    assert reward == 0.0 and list(env.body) == [(6, 6), (5, 6), (5, 5), (5, 4)]


def test_hitting_a_wall_terminates_with_minus_one() -> None:
    env = _env()
    _placed(env, [(0, 3), (1, 3), (2, 3)], UP, food=(9, 9))
    _, reward, terminated, truncated, _ = env.step(STRAIGHT)
    assert (reward, terminated, truncated) == (-1.0, True, False)


def test_hitting_the_body_terminates_but_the_leaving_tail_is_free() -> None:
    env = _env()
    # A 5-long snake curled so that turning right three times runs into its own neck.
    _placed(env, [(5, 5), (5, 4), (4, 4), (4, 5), (4, 6)], EAST, food=(9, 9))
    _, reward, terminated, *_ = env.step(LEFT)  # up into (4, 5): body, not the tail
    assert (reward, terminated) == (-1.0, True)
    env = _env()
    # A square of 4: the head moves into the cell the tail leaves this step.
    _placed(env, [(5, 5), (5, 4), (4, 4), (4, 5)], EAST, food=(9, 9))
    _, reward, terminated, *_ = env.step(LEFT)
    assert (reward, terminated) == (0.0, False)
    assert list(env.body) == [(4, 5), (5, 5), (5, 4), (4, 4)]


def test_food_is_never_under_the_body() -> None:
    env = _env(size=5)
    cells = [(r, c if r % 2 == 0 else 4 - c) for r in range(5) for c in range(5)]
    for trial in range(200):  # all but two cells taken: food must land on one of the two
        env.np_random = np.random.default_rng(trial)
        env.body = deque(cells[:23])
        assert env._place_food() in {cells[23], cells[24]}


def test_filling_the_board_ends_the_episode_after_the_last_food() -> None:
    env = _env(size=5)
    cells = [(r, c if r % 2 == 0 else 4 - c) for r in range(5) for c in range(5)]
    # Head at cells[23] heading to cells[24] (the last free cell, with the food on it).
    _placed(env, list(reversed(cells[:24])), EAST, food=cells[24])
    _, reward, terminated, truncated, info = env.step(STRAIGHT)
    assert (reward, terminated, truncated) == (1.0, True, False) and info["length"] == 25
    assert env.food is None


def test_hunger_truncates_the_episode() -> None:
    env = _env(max_hunger=3)
    _placed(env, [(5, 2), (5, 1), (5, 0)], EAST, food=(0, 0))
    outcomes = [env.step(STRAIGHT)[2:4] for _ in range(3)]
    assert outcomes == [(False, False), (False, False), (False, True)]
    assert _env().max_hunger == 100  # default: the number of cells


def test_features_danger_heading_and_food_direction() -> None:
    env = _env()
    _placed(env, [(0, 9), (1, 9), (2, 9)], UP, food=(5, 0))  # top-right corner, heading up
    features = env._observe()
    assert features[:3].tolist() == [1, 1, 0]  # wall straight on and to the right; left free
    assert features[3:7].tolist() == [1, 0, 0, 0]
    assert features[7:11].tolist() == [0, 0, 1, 1]  # food is down and to the left
    assert env.observation_space.contains(features)


def test_grid_observation_planes() -> None:
    env = _env(observation="grid", size=6)
    _placed(env, [(2, 2), (2, 1)], EAST, food=(4, 4))
    grid = env._observe()
    assert grid.shape == (6, 6, 3) and env.observation_space.contains(grid)
    assert grid[..., 0].sum() == 2 and grid[2, 2, 1] == 1 and grid[..., 1].sum() == 1
    assert grid[4, 4, 2] == 1 and grid[..., 2].sum() == 1


@pytest.mark.parametrize("observation", ["features", "grid"])
def test_passes_gymnasium_check_env_and_renders(observation: str) -> None:
    env = make_env("Snake-v0", kwargs={"observation": observation}, render_mode="rgb_array")
    check_env(env.unwrapped)
    env.reset(seed=3)
    frame = env.render()
    assert isinstance(frame, np.ndarray) and frame.shape == (160, 160, 3)
    assert frame.dtype == np.uint8


def test_bad_arguments_are_explained() -> None:
    with pytest.raises(ValueError, match=r"size must be in 5\.\.64"):
        SnakeEnv(size=3)
    with pytest.raises(ValueError, match="observation must be 'features' or 'grid'"):
        SnakeEnv(observation="pixels")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="action must be 0"):
        _env().step(3)


def test_listed_by_rlfleet_envs(capsys: pytest.CaptureFixture[str]) -> None:
    assert [e.env_id for e in list_local_envs("snake")] == ["Snake-v0"]
    assert rlfleet(["envs"]) == 0
    assert "Snake-v0" in capsys.readouterr().out


def test_the_example_run_file_trains_snake_through_the_fleet() -> None:
    root = Path(__file__).resolve().parents[2]
    config = load_run_config(root / "examples" / "snake_ppo.yaml", environ={})
    learner = config.service("learner").settings
    assert learner.env_id == "Snake-v0" and learner.total_timesteps == 1_000_000
    assert [e.service for e in config.services].count("game_actor") == 2
