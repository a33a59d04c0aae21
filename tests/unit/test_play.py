"""env_server.play: the final-policy layout, resolving what `rlfleet play` is pointed at, acting,
recording, and the command's output and exit codes. Nothing is trained: policies are freshly
built by common.policies and saved with the learner's writer (`save_policy`)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import torch

from common.artifacts import (
    DESCRIPTION_FILE,
    WEIGHTS_FILE,
    LoadedPolicy,
    load_policy,
    resolve_policy_dir,
    save_policy,
)
from common.policies import build_policy
from common.policy_config import PolicyConfig
from env_server.play import _FrameDir, play
from services import cli
from services.errors import ConfigError

CARTPOLE_OBS = gym.spaces.Box(-np.inf, np.inf, (4,), np.float32)
CARTPOLE_ACT = gym.spaces.Discrete(2)


def save(final: Path, env_id: str = "CartPole-v1", **overrides) -> torch.nn.Module:
    """A fresh policy for CartPole saved as the learner saves its final one."""
    torch.manual_seed(0)
    config = PolicyConfig(hidden_sizes=(8,))
    net = build_policy(CARTPOLE_OBS, CARTPOLE_ACT, config)
    fields = dict(
        env_id=env_id,
        env_kwargs={},
        observation_space=CARTPOLE_OBS,
        action_space=CARTPOLE_ACT,
        policy=config,
        algo="ppo",
        version=3,
        global_step=1024,
        updates=3,
    )
    fields.update(overrides)
    save_policy(final, net.state_dict(), **fields)
    return net


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    run = tmp_path / "runs" / "cartpole-ppo"
    (run / "logs").mkdir(parents=True)
    (run / "config.yaml").write_text("run: {name: cartpole-ppo}\n")
    save(run / "final")
    return run


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = cli.main(argv)
    out, err = capsys.readouterr()
    return code, out, err


# ------------------------------------------------------------------------------------- layout


def test_layout_round_trip(run_dir: Path) -> None:
    final = run_dir / "final"
    assert sorted(p.name for p in final.iterdir()) == [DESCRIPTION_FILE, WEIGHTS_FILE]
    description = json.loads((final / DESCRIPTION_FILE).read_text())
    assert list(description) == [
        "env_id", "env_kwargs", "observation_space", "action_space", "policy",
        "algo", "version", "global_step", "updates",
    ]  # fmt: skip
    assert description["policy"] == PolicyConfig(hidden_sizes=(8,)).model_dump(mode="json")
    loaded = load_policy(run_dir)
    assert loaded.env_id == "CartPole-v1" and loaded.directory == final
    assert loaded.observation_space == CARTPOLE_OBS and loaded.action_space == CARTPOLE_ACT
    saved = torch.load(final / WEIGHTS_FILE, weights_only=True)
    for name, tensor in loaded.net.state_dict().items():
        torch.testing.assert_close(tensor, saved[name])
    assert not loaded.net.training


def test_resolves_run_dir_final_dir_files_name_and_config(run_dir: Path) -> None:
    final = run_dir / "final"
    runs_root = run_dir.parent
    assert resolve_policy_dir(run_dir) == final
    assert resolve_policy_dir(final) == final
    assert resolve_policy_dir(final / DESCRIPTION_FILE) == final
    assert resolve_policy_dir(final / WEIGHTS_FILE) == final
    assert resolve_policy_dir("cartpole-ppo", runs_root) == final
    config = run_dir.parent.parent / "run.yaml"
    config.write_text(
        f"run: {{name: cartpole-ppo, dir: {run_dir}}}\n"
        "services: [{name: beat, service: heartbeat}]\n"
    )
    assert resolve_policy_dir(config) == final


def test_unknown_name_suggests_runs(run_dir: Path) -> None:
    with pytest.raises(ConfigError, match=r"no run or policy at 'cartpole-pp'.*cartpole-ppo\?"):
        resolve_policy_dir("cartpole-pp", run_dir.parent)


def test_run_without_final_policy(run_dir: Path) -> None:
    for path in (run_dir / "final").iterdir():
        path.unlink()
    (run_dir / "final").rmdir()
    with pytest.raises(ConfigError, match="run has no final policy"):
        resolve_policy_dir(run_dir)


def test_folder_that_is_not_a_run(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not a run directory"):
        resolve_policy_dir(tmp_path)
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(ConfigError, match="not a run directory"):
        resolve_policy_dir(tmp_path / "notes.txt")


def test_missing_weights(run_dir: Path) -> None:
    (run_dir / "final" / WEIGHTS_FILE).unlink()
    with pytest.raises(ConfigError, match=f"missing {WEIGHTS_FILE}"):
        load_policy(run_dir)


def test_weights_that_do_not_fit(run_dir: Path) -> None:
    other = build_policy(CARTPOLE_OBS, CARTPOLE_ACT, PolicyConfig(hidden_sizes=(16,)))
    torch.save(other.state_dict(), run_dir / "final" / WEIGHTS_FILE)
    with pytest.raises(ConfigError, match="does not fit the policy"):
        load_policy(run_dir)


def test_bad_description(run_dir: Path) -> None:
    path = run_dir / "final" / DESCRIPTION_FILE
    description = json.loads(path.read_text())
    path.write_text("{not json")
    with pytest.raises(ConfigError, match="cannot read"):
        load_policy(run_dir)
    path.write_text(json.dumps({**description, "policy": {"hidden_size": 8}}))
    with pytest.raises(ConfigError, match="hidden_size"):
        load_policy(run_dir)
    del description["action_space"]
    path.write_text(json.dumps(description))
    with pytest.raises(ConfigError, match=r"missing key.*action_space"):
        load_policy(run_dir)


# ------------------------------------------------------------------------------------ acting


def loaded(observation_space, action_space, **config) -> LoadedPolicy:
    net = build_policy(observation_space, action_space, PolicyConfig(**config)).eval()
    return LoadedPolicy(Path("."), {}, "x", {}, observation_space, action_space, net)


def test_greedy_and_sampled_discrete_actions() -> None:
    policy = loaded(CARTPOLE_OBS, gym.spaces.Discrete(3, start=1), hidden_sizes=(8,))
    with torch.no_grad():
        policy.net.actor[-1].bias.copy_(torch.tensor([0.0, 2.0, 0.0]))  # p(action 2) ~ 0.79
    obs = np.zeros(4, np.float32)
    assert policy.act(obs, deterministic=True) == 2
    generator = torch.Generator().manual_seed(0)
    draws = [int(policy.act(obs, generator=generator)) for _ in range(2000)]
    assert set(draws) == {1, 2, 3}
    probs = torch.softmax(policy.net.actor(torch.zeros(1, 4)), -1)[0].detach().numpy()
    freq = np.bincount(draws, minlength=4)[1:] / len(draws)
    np.testing.assert_allclose(freq, probs, atol=0.04)
    generator = torch.Generator().manual_seed(0)
    assert draws[:50] == [int(policy.act(obs, generator=generator)) for _ in range(50)]


def test_multidiscrete_and_box_actions() -> None:
    multi = loaded(CARTPOLE_OBS, gym.spaces.MultiDiscrete([2, 3]))
    action = multi.act(np.zeros(4, np.float32))
    assert action.shape == (2,) and multi.action_space.contains(action)
    assert multi.act(np.zeros(4, np.float32), deterministic=True).shape == (2,)
    box = gym.spaces.Box(-1.0, 1.0, (2,), np.float32)
    cont = loaded(CARTPOLE_OBS, box, init_log_std=1.0)
    mean = cont.act(np.zeros(4, np.float32), deterministic=True)
    assert mean.shape == (2,) and mean.dtype == np.float32
    np.testing.assert_allclose(mean, 0.0, atol=0.05)  # head gain 0.01, zero bias
    samples = np.stack([cont.act(np.zeros(4, np.float32)) for _ in range(200)])
    assert box.contains(samples[0]) and samples.std() > 0.3  # clipped to the bounds


# --------------------------------------------------------------------------------- recording


@pytest.mark.parametrize("shape", [(5, 7, 3), (5, 7, 4), (5, 7)])
def test_png_frames_round_trip(tmp_path: Path, shape: tuple[int, ...]) -> None:
    from PIL import Image

    frame = np.random.default_rng(0).integers(0, 256, shape, dtype=np.uint8)
    recorder = _FrameDir(tmp_path / "frames")
    recorder.add(frame, episode=0, step=0)
    assert recorder.close() == f"1 frames in {tmp_path / 'frames'}/"
    written = np.asarray(Image.open(tmp_path / "frames" / "ep000_000000.png"))
    np.testing.assert_array_equal(written, frame)


def test_frames_and_gif(run_dir: Path, tmp_path: Path) -> None:
    frames = tmp_path / "frames"
    result = play(run_dir, episodes=2, frames=frames, max_steps=15)
    first = result.episodes[0]
    names = sorted(p.name for p in frames.iterdir())
    assert len(names) == first.length + 1 and names[0] == "ep000_000000.png"  # first episode
    from PIL import Image as image

    assert image.open(frames / names[0]).size == (600, 400)  # CartPole's rgb_array
    result = play(run_dir, episodes=1, video=tmp_path / "run.gif", max_steps=15)
    gif = image.open(tmp_path / "run.gif")
    total_ms = 0  # Pillow merges identical consecutive frames, adding up their durations
    for index in range(gif.n_frames):
        gif.seek(index)
        total_ms += gif.info["duration"]
    assert total_ms == (result.episodes[0].length + 1) * round(1000 / 50)  # CartPole: 50 fps
    assert result.recording and "run.gif" in result.recording


# ----------------------------------------------------------------------------------- command


def test_play_reports_each_episode_and_the_mean(
    run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    summary = tmp_path / "summary.json"
    code, out, err = run_cli(
        ["play", str(run_dir), "--episodes", "3", "--seed", "5", "--json", str(summary)], capsys
    )
    assert code == 0, err
    lines = out.splitlines()
    episodes = [line for line in lines if line.startswith("episode")]
    assert len(episodes) == 3
    returns = [float(re.search(r"return\s+(\S+)", line)[1]) for line in episodes]
    assert all(r > 0 for r in returns)
    mean_line = lines[-1]
    assert mean_line.startswith("mean over 3 episodes of CartPole-v1 (sampled actions")
    assert f"return {np.mean(returns):.2f} ± {np.std(returns):.2f}" in mean_line
    data = json.loads(summary.read_text())
    assert data["episodes"] == 3 and [e["seed"] for e in data["episodes_detail"]] == [5, 6, 7]
    assert data["mean_return"] == pytest.approx(np.mean(returns), abs=0.01)
    # same seed, same episodes
    again = run_cli(["play", str(run_dir), "--episodes", "3", "--seed", "5"], capsys)[1]
    assert again.splitlines()[:3] == episodes


def test_play_deterministic_and_run_name(
    run_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(run_dir.parent.parent)  # runs/ is looked up from the working directory
    code, out, err = run_cli(["play", "cartpole-ppo", "--episodes", "2", "--deterministic"], capsys)
    assert code == 0, err
    assert "(greedy actions" in out.splitlines()[-1]


def test_max_steps_caps_episodes(run_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(["play", str(run_dir), "--episodes", "1", "--max-steps", "3"], capsys)
    assert code == 0
    assert "length      3  (stopped at --max-steps 3)" in out


@pytest.mark.parametrize(
    ("setup", "argv", "message"),
    [
        (None, ["play", "{tmp}/nowhere"], "no run or policy at"),
        ("no-final", ["play", "{run}"], "run has no final policy"),
        ("no-weights", ["play", "{run}"], f"missing {WEIGHTS_FILE}"),
        ("unknown-env", ["play", "{run}"], "unknown env id 'NoSuchEnv-v0'"),
        ("other-space", ["play", "{run}"], "differs from the policy's"),
        (None, ["play", "{run}", "--video", "{tmp}/x.avi2"], "unknown format '.avi2'"),
        (None, ["play", "{run}", "--video", "{tmp}/no/dir/x.gif"], "does not exist"),
    ],
)
def test_clear_errors_exit_2(
    run_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    setup: str | None,
    argv: list[str],
    message: str,
) -> None:
    final = run_dir / "final"
    if setup == "no-final":
        for path in final.iterdir():
            path.unlink()
        final.rmdir()
    elif setup == "no-weights":
        (final / WEIGHTS_FILE).unlink()
    elif setup == "unknown-env":
        save(final, env_id="NoSuchEnv-v0")
    elif setup == "other-space":
        save(final, env_id="MountainCar-v0")  # 2 observations, the policy expects 4
    argv = [a.format(tmp=tmp_path, run=run_dir) for a in argv]
    code, out, err = run_cli(argv, capsys)
    assert code == 2
    assert err.startswith("rlfleet: error: ") and message in err, err
    assert "Traceback" not in err and "episode" not in out


def test_mp4_recording(run_dir: Path, tmp_path: Path) -> None:
    import imageio.v3 as iio

    result = play(run_dir, episodes=1, video=tmp_path / "run.mp4", max_steps=15)
    frames = iio.imread(tmp_path / "run.mp4", plugin="FFMPEG", index=None)
    assert frames.shape == (result.episodes[0].length + 1, 400, 600, 3)  # CartPole's rgb_array
    assert result.recording and "run.mp4" in result.recording
