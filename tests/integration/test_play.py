"""`rlfleet play` against what the learner writes, and as the installed command.

- the learner's own `save_final` (the code a finished run executes; called here on a stand-in
  learner, no engine or bus) writes a folder that `play` loads and runs;
- `python -m launch.cli play` in a subprocess: a plugin env (flappy_bird_gymnasium's
  FlappyBird-v0 with env_kwargs) recorded to a GIF and a frame folder, and exit code 2 with a
  one-line message for a path that is not a run;
- ``--video`` without a PATH, or a PATH without a suffix, writes an MP4 (imageio-ffmpeg's own
  ffmpeg) holding every frame; the score and return are drawn on the frames unless
  ``--no-overlay``; a GIF (by its suffix) stops after GIF_MAX_SECONDS and says so;
- ``--env path/to/file.py:Name`` plays in the env a run file would name that way, and a bad
  reference is a one-line error (exit 2).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import gymnasium as gym
import imageio.v3 as iio
import numpy as np
import pytest
import torch

from common.artifacts import DESCRIPTION_FILE, WEIGHTS_FILE, save_policy
from common.policies import build_policy
from common.policy_config import PolicyConfig
from env_server import play as play_module
from env_server.play import play
from learner.game.workload import GameWorkload

ROOT = Path(__file__).resolve().parents[2]


def test_learner_final_policy_plays(tmp_path: Path) -> None:
    spaces = (gym.spaces.Box(-np.inf, np.inf, (4,), np.float32), gym.spaces.Discrete(2))
    config = PolicyConfig(hidden_sizes=(16, 16))
    net = build_policy(*spaces, config)
    run = tmp_path / "runs" / "cartpole"
    workload = GameWorkload.__new__(GameWorkload)  # no engine or bus: only what saving reads
    workload.engine = SimpleNamespace(named_weights=lambda dtype: net.state_dict())  # type: ignore[assignment]
    workload.spaces = spaces
    workload.settings = SimpleNamespace(  # type: ignore[assignment]
        env_id="CartPole-v1", env_kwargs={}, policy=config, algo="ppo"
    )
    progress = SimpleNamespace(version=7, samples=4096, updates=7)
    workload.save_final(run / "final", progress)  # type: ignore[arg-type]
    description = json.loads((run / "final" / DESCRIPTION_FILE).read_text())
    assert description["env_id"] == "CartPole-v1" and description["version"] == 7
    assert description["complete"] is True and "stopped_at_update" not in description
    assert description["global_step"] == 4096 and description["algo"] == "ppo"
    result = play(run, episodes=4)
    assert len(result.episodes) == 4 and all(e.length > 0 for e in result.episodes)
    returns = [e.ret for e in result.episodes]
    assert result.summary()["mean_return"] == pytest.approx(np.mean(returns))


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "launch.cli", "play", *args],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def _flappy(root: Path) -> Path:
    from env_server.registry import make_env

    kwargs = {"use_lidar": False}
    env = make_env("FlappyBird-v0", kwargs=kwargs)
    torch.manual_seed(0)
    config = PolicyConfig()
    net = build_policy(env.observation_space, env.action_space, config)
    final = root / "runs" / "flappy" / "final"
    save_policy(
        final, net.state_dict(), env_id="FlappyBird-v0", env_kwargs=kwargs,
        observation_space=env.observation_space, action_space=env.action_space, policy=config,
    )  # fmt: skip
    env.close()
    return final


def _cartpole(root: Path) -> Path:
    spaces = (gym.spaces.Box(-np.inf, np.inf, (4,), np.float32), gym.spaces.Discrete(2))
    config = PolicyConfig(hidden_sizes=(16, 16))
    torch.manual_seed(0)
    final = root / "runs" / "cartpole" / "final"
    save_policy(
        final, build_policy(*spaces, config).state_dict(), env_id="CartPole-v1", env_kwargs={},
        observation_space=spaces[0], action_space=spaces[1], policy=config,
    )  # fmt: skip
    return final


def _length(stdout: str) -> int:
    line = next(line for line in stdout.splitlines() if line.startswith("episode"))
    return int(line.split("length")[1].split()[0])


def test_cli_plays_a_plugin_env_and_records(tmp_path: Path) -> None:
    final = _flappy(tmp_path)

    done = _cli("flappy", "--episodes", "3", "--video", "play.gif", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert sum(line.startswith("episode") for line in lines) == 3
    assert all(" score " in line for line in lines if line.startswith("episode"))
    assert any(line.startswith("mean over 3 episodes of FlappyBird-v0") for line in lines)
    assert (tmp_path / "play.gif").stat().st_size > 0 and "recorded" in lines[-1]

    done = _cli(str(final), "--episodes", "2", "--frames", "frames", "--record-episodes", "2",
                "--deterministic", cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stderr
    lengths = [int(line.split("length")[1].split()[0]) for line in done.stdout.splitlines()
               if line.startswith("episode")]  # fmt: skip
    assert len(list((tmp_path / "frames").glob("*.png"))) == sum(lengths) + 2


def test_cli_invalid_path_exits_2(tmp_path: Path) -> None:
    done = _cli("no-such-run", cwd=tmp_path)
    assert done.returncode == 2
    assert done.stderr.strip() == (
        "rlfleet: error: no run or policy at 'no-such-run' (nor at runs/no-such-run)"
    )
    (tmp_path / "final").mkdir()
    (tmp_path / "final" / DESCRIPTION_FILE).write_text("{}")
    done = _cli("final", cwd=tmp_path)
    assert done.returncode == 2 and f"missing {WEIGHTS_FILE}" in done.stderr


def test_video_is_mp4_by_default(tmp_path: Path) -> None:
    _flappy(tmp_path)
    done = _cli("flappy", "--episodes", "1", "--video", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == f"recorded {_length(done.stdout) + 1} frames in play.mp4"
    frames = iio.imread(tmp_path / "play.mp4", index=None)
    assert frames.shape == (_length(done.stdout) + 1, 512, 288, 3)

    done = _cli("flappy", "--episodes", "1", "--video", "clip", "--no-overlay", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1].endswith(" frames in clip.mp4")
    assert len(iio.imread(tmp_path / "clip.mp4", index=None)) == len(frames)

    # WebM (what browsers play whatever their build): VP9, every frame.
    done = _cli("flappy", "--episodes", "1", "--video", "clip.webm", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert len(iio.imread(tmp_path / "clip.webm", index=None)) == len(frames)


def test_score_is_drawn_on_the_frames(tmp_path: Path) -> None:
    final = _flappy(tmp_path)
    for folder, overlay in (("drawn", True), ("plain", False)):
        play(final, episodes=1, deterministic=True, frames=tmp_path / folder, overlay=overlay)
    names = sorted(p.name for p in (tmp_path / "plain").glob("*.png"))
    assert names and names == sorted(p.name for p in (tmp_path / "drawn").glob("*.png"))
    for name in names:
        drawn = iio.imread(tmp_path / "drawn" / name).astype(int)
        plain = iio.imread(tmp_path / "plain" / name).astype(int)
        changed = np.abs(drawn - plain).sum(axis=-1) > 0
        rows, cols = np.nonzero(changed)
        # The text ("score 0", "return -7.5") in the top left corner, nothing elsewhere.
        assert rows.size > 100 and rows.max() < 512 // 4 and cols.max() < 288 // 2, name


def test_gif_stops_after_its_limit_and_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    final = _flappy(tmp_path)
    monkeypatch.setattr(play_module, "GIF_MAX_SECONDS", 0.5)  # 15 frames at 30 fps
    result = play(final, episodes=1, video=tmp_path / "short.gif")
    dropped = result.episodes[0].length + 1 - 15
    assert dropped > 0
    assert result.recording == (
        f"15 frames in {tmp_path / 'short.gif'}: the GIF stops after 0.5 s (15 frames at 30 "
        f"fps), {dropped} later frames left out; record to {tmp_path / 'short.mp4'} for all "
        "of them"
    )
    assert len(iio.imread(tmp_path / "short.gif", index=None)) == 15


def test_env_named_by_reference_as_in_run_files(tmp_path: Path) -> None:
    _cartpole(tmp_path)
    (tmp_path / "envs").mkdir()
    (tmp_path / "envs" / "carts.py").write_text(
        "from gymnasium.envs.classic_control import CartPoleEnv\n\n\n"
        "class SlowCart(CartPoleEnv):\n"
        "    def __init__(self, render_mode=None):\n"
        "        super().__init__(render_mode=render_mode)\n"
        "        self.force_mag = 5.0\n"
    )
    done = _cli("cartpole", "--episodes", "2", "--env", "envs/carts.py:SlowCart", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "mean over 2 episodes of envs/carts.py:SlowCart" in done.stdout

    done = _cli("cartpole", "--env", "envs/carts.py:FastCart", cwd=tmp_path)
    assert done.returncode == 2
    assert done.stderr.strip().startswith("rlfleet: error: env 'envs/carts.py:FastCart' — ")
    assert "has no attribute 'FastCart'" in done.stderr
