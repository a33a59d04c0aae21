"""No silent stall: once nothing can feed the learner, `rlfleet up` says so within seconds and
ends the run failed (`run.when_producers_gone: stop`, the default) or keeps it up
(`wait`) (launch/producers.py).

Real parts throughout: `python -m launch.cli up` in a subprocess, the real nats-server, env
server, DeepSpeed learner, and either a Python game on the GameLink SDK that says Goodbye after
a few ticks, or a game actor that finishes its `total_steps`, both long before the learner's
`total_timesteps`.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.fixtures.launch import Up, assert_nothing_left

pytestmark = [
    pytest.mark.skipif(sys.platform != "linux", reason="scans /proc"),
    pytest.mark.timeout(300),
]

GONE = "no producer of training data left"
SAID_WITHIN_S = 20.0  # the launcher says it within seconds; slack for a loaded machine

# Snake-v0 boards as the agents of one link; Goodbye after TICKS ticks, then the game exits.
GAME = """\
import pathlib, sys
import numpy as np
from env_server.envs.snake import SnakeEnv
from clients.game_link import GameLink

n, ticks = 2, int(sys.argv[1])
boards = [SnakeEnv() for _ in range(n)]
obs = np.stack([b.reset(seed=i)[0] for i, b in enumerate(boards)])
rew, term, trunc = np.zeros(n, np.float32), np.zeros(n, bool), np.zeros(n, bool)
episode = np.arange(n, dtype=np.int64) * 1_000_000
space = boards[0]
link = GameLink(game="snake-py", env_id="Snake-v0", observation_space=space.observation_space,
                action_space=space.action_space, num_agents=n)
for _ in range(ticks):
    actions = link.act(obs, rew, term, trunc, episode)
    for i, board in enumerate(boards):
        if term[i] or trunc[i]:
            obs[i], rew[i], term[i], trunc[i] = board.reset()[0], 0.0, False, False
            episode[i] += 1
        else:
            obs[i], rew[i], term[i], trunc[i], _ = board.step(int(actions[i]))
link.close("the player quit")
pathlib.Path("goodbye").write_text("said")
"""


def _game_run(tmp_path: Path, when: str | None) -> tuple[Path, Path]:
    (tmp_path / "game.py").write_text(GAME)
    run_dir = tmp_path / "run"
    run: dict[str, object] = {"name": "gone-game", "dir": str(run_dir)}
    if when is not None:
        run["when_producers_gone"] = when
    config = {
        "run": run,
        "job": {
            "kind": "ppo",
            "env_id": "Snake-v0",
            "rollout_length": 16,
            "total_timesteps": 1_000_000,
            "minibatch_size": 32,
            "device": "cpu",
            # One fragment and a half: the learner trains once, then waits for more.
            "game": {"command": [sys.executable, "game.py", "24"], "instances": 1},
        },
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    return path, run_dir


def _said_after_goodbye(up: Up, tmp_path: Path) -> float:
    """Seconds from the game's Goodbye to the launcher's line."""
    goodbye = tmp_path / "goodbye"
    up.wait_until("the game's Goodbye", goodbye.exists)
    said = time.monotonic()
    up.wait_for(GONE, timeout_s=SAID_WITHIN_S)
    return time.monotonic() - said


def test_the_last_game_saying_goodbye_ends_the_run_with_a_clear_reason(tmp_path: Path) -> None:
    config, run_dir = _game_run(tmp_path, None)  # the default: stop
    up = Up(config, run_dir, services=("env-0", "game-0", "learner"), budget_s=240)
    try:
        _said_after_goodbye(up, tmp_path)
        assert up.wait(30) == 1, up.diagnostics()
        line = next(line for line in up.lines if GONE in line)
        assert "env-0 (its last game link ended" in line, line
        assert "learner still waits for rollout fragments" in line, line
        assert "ending the run: learner cannot finish without a producer" in up.output
        assert "(run.when_producers_gone: stop" in up.output
        assert_nothing_left(run_dir)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{up.diagnostics()}") from None
    finally:
        up.stop()


def test_wait_keeps_the_run_up_after_the_last_game_left(tmp_path: Path) -> None:
    config, run_dir = _game_run(tmp_path, "wait")
    up = Up(config, run_dir, services=("env-0", "game-0", "learner"), budget_s=240)
    try:
        _said_after_goodbye(up, tmp_path)
        assert "waiting for one to come back (run.when_producers_gone: wait)" in up.output
        # The learner's own wait shows on the console too (services/waits.py).
        up.wait_for(r"learner: waiting for fragments for update \d+ \(\d+ s\)", 40)
        assert up.proc.poll() is None, "the run ended though told to wait"
        assert "ending the run" not in up.output
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{up.diagnostics()}") from None
    finally:
        up.stop()
    assert_nothing_left(run_dir)


def test_actors_that_all_finish_before_the_learner_end_the_run_with_a_clear_reason(
    tmp_path: Path,
) -> None:
    run_dir = tmp_path / "run"
    actor = {
        "env_servers": ["env-0"],
        "env_id": "CartPole-v1",
        "num_envs": 2,
        "rollout_length": 16,
        "policy": "learner",
        "learner": "learner",
        "fragments_per_version": 1,
        "total_steps": 64,  # two fragments, then the actor is done (exit 0)
    }
    config = {
        "run": {"name": "gone-actors", "dir": str(run_dir)},
        "services": [
            {"name": "env-0", "service": "env_server", "settings": {"preload": ["CartPole-v1"]}},
            {
                "name": "learner",
                "service": "learner",
                "main": True,
                "settings": {
                    "env_servers": ["env-0"],
                    "total_timesteps": 100_000,
                    "minibatch_size": 32,
                    "fragments_per_update": 1,
                    "device": "cpu",
                },
            },
            {"name": "actor-0", "service": "game_actor", "settings": actor},
        ],
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    up = Up(path, run_dir, services=("env-0", "learner", "actor-0"), budget_s=240)
    try:
        up.wait_for(r"actor-0 finished \(exit 0\)", timeout_s=200)
        up.wait_for(GONE, timeout_s=SAID_WITHIN_S)
        assert up.wait(30) == 1, up.diagnostics()
        line = next(line for line in up.lines if GONE in line)
        assert "actor-0 (finished)" in line, line
        assert "learner still waits for rollout fragments" in line, line
        assert "ending the run" in up.output
        assert_nothing_left(run_dir)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{up.diagnostics()}") from None
    finally:
        up.stop()


def test_a_run_waiting_for_its_first_game_says_so_and_is_not_gone(tmp_path: Path) -> None:
    # The game never links: the env server says what it waits for; nothing is "gone".
    config, run_dir = _game_run(tmp_path, None)
    data = yaml.safe_load(config.read_text())
    data["job"]["game"]["command"] = [sys.executable, "-c", "import time; time.sleep(600)"]
    config.write_text(yaml.safe_dump(data))
    up = Up(config, run_dir, services=("env-0", "game-0", "learner"), budget_s=120)
    try:
        up.wait_for(r"env-0: waiting for a game to link at 127\.0\.0\.1:\d+ .*\(1\d s\)", 60)
        assert GONE not in up.output
        assert up.proc.poll() is None
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{up.diagnostics()}") from None
    finally:
        up.stop()
    assert_nothing_left(run_dir)
