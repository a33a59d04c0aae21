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
    POLICY_STATE_KEY,
    WEIGHTS_FILE,
    LoadedPolicy,
    load_policy,
    policy_description,
    resolve_policy_dir,
    save_policy,
)
from common.policies import build_policy
from common.policy_config import PolicyConfig
from env_server.play import _FrameDir, play
from launch import cli
from services.errors import ConfigError, InvalidArgument

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
    with pytest.raises(ConfigError, match=r"run has no final policy .* and no checkpoint"):
        resolve_policy_dir(run_dir)
    (run_dir / "checkpoints").mkdir()
    with pytest.raises(ConfigError, match="holds no checkpoint"):
        resolve_policy_dir(run_dir)


# ---------------------------------------------------------------- a run without final/: checkpoints


def checkpoint(run: Path, tag: str, net: torch.nn.Module, described: bool = True) -> Path:
    """A DeepSpeed ZeRO 0-2 checkpoint tag as the game learner leaves it: the rank-0 model
    states file with ``module`` and the client state (``policy_description`` when described)."""
    folder = run / "checkpoints" / tag
    folder.mkdir(parents=True)
    state = {
        "module": net.state_dict(),
        "ds_config": {"zero_optimization": {"stage": 2}},
        "updates": 5,
        "samples": 640,
        "version": 5,
        "returns": [10.0],
    }
    if described:
        state[POLICY_STATE_KEY] = policy_description(
            env_id="CartPole-v1", env_kwargs={}, observation_space=CARTPOLE_OBS,
            action_space=CARTPOLE_ACT, policy=PolicyConfig(hidden_sizes=(8,)), algo="ppo",
        )  # fmt: skip
    torch.save(state, folder / "mp_rank_00_model_states.pt")
    (run / "checkpoints" / "latest").write_text(tag)
    return folder


def without_final(run: Path) -> torch.nn.Module:
    net = save(run / "final")
    for path in (run / "final").iterdir():
        path.unlink()
    (run / "final").rmdir()
    with torch.no_grad():
        for tensor in net.parameters():
            tensor.add_(0.5)  # differs from the policy save() builds
    return net


def assert_same_weights(loaded: LoadedPolicy, net: torch.nn.Module) -> None:
    for name, tensor in net.state_dict().items():
        torch.testing.assert_close(loaded.net.state_dict()[name], tensor)


def test_run_without_final_plays_its_latest_checkpoint(run_dir: Path) -> None:
    net = without_final(run_dir)
    older = checkpoint(run_dir, "update-00000003", save(run_dir / "x"))
    tag = checkpoint(run_dir, "update-00000005", net)
    assert (
        resolve_policy_dir(run_dir) == tag
        and resolve_policy_dir("cartpole-ppo", run_dir.parent) == tag
    )
    for source in (run_dir, run_dir / "checkpoints", tag, tag / "mp_rank_00_model_states.pt"):
        policy = load_policy(source)
        assert policy.directory == tag and not policy.complete
        assert policy.description["source"] == "checkpoint"
        assert (policy.description["updates"], policy.description["global_step"]) == (5, 640)
        assert policy.observation_space == CARTPOLE_OBS and policy.action_space == CARTPOLE_ACT
        assert_same_weights(policy, net)
    assert load_policy(older).directory == older
    result = play(run_dir, episodes=2)
    assert result.policy_note is not None and "update-00000005" in result.policy_note


def test_checkpoint_without_description_rebuilds_from_the_run_config(run_dir: Path) -> None:
    net = without_final(run_dir)
    tag = checkpoint(run_dir, "update-00000005", net, described=False)
    (run_dir / "config.yaml").write_text(
        "run: {name: cartpole-ppo}\njob: {kind: ppo, env_id: CartPole-v1, hidden_sizes: [8]}\n"
    )
    policy = load_policy(run_dir)
    assert policy.env_id == "CartPole-v1" and policy.directory == tag
    assert policy.description["algo"] == "ppo"
    assert_same_weights(policy, net)
    (run_dir / "config.yaml").unlink()
    with pytest.raises(ConfigError, match=r"does not describe its policy.*no run config"):
        load_policy(run_dir)


def test_stopped_final_gives_way_to_a_newer_checkpoint(run_dir: Path) -> None:
    net = without_final(run_dir)
    save(run_dir / "final", updates=3, complete=False, stopped_at_update=3)
    tag = checkpoint(run_dir, "update-00000005", net)
    assert resolve_policy_dir(run_dir) == tag  # killed after a later checkpoint than the stop
    save(run_dir / "final", updates=5, complete=False, stopped_at_update=5)
    assert resolve_policy_dir(run_dir) == run_dir / "final"
    policy = load_policy(run_dir)
    assert not policy.complete
    assert "stopped at update 5" in (play(run_dir, episodes=1).policy_note or "")


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


def test_predict_takes_one_observation_or_a_batch() -> None:
    policy = loaded(CARTPOLE_OBS, CARTPOLE_ACT, hidden_sizes=(8,))
    batch = np.random.default_rng(0).normal(size=(5, 4)).astype(np.float32)
    actions = policy.predict(batch, deterministic=True)
    assert actions.shape == (5,) and actions.dtype == np.int64
    singles = [policy.predict(o, deterministic=True) for o in batch]
    assert list(actions) == singles == [policy.act(o, deterministic=True) for o in batch]
    assert np.ndim(singles[0]) == 0 and CARTPOLE_ACT.contains(int(singles[0]))
    assert policy.predict(batch.tolist()).shape == (5,)  # lists too; sampled
    box = loaded(CARTPOLE_OBS, gym.spaces.MultiDiscrete([2, 3]))
    assert box.predict(batch).shape == (5, 2) and box.predict(batch[0]).shape == (2,)
    with pytest.raises(InvalidArgument, match=r"observation of shape \(3,\)"):
        policy.predict(np.zeros(3, np.float32))


def readme_snippet() -> str:
    """The README's "Use the trained policy from Python" code block, as written."""
    text = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = text.split("### Use the trained policy from Python", 1)[1]
    return section.split("```python\n", 1)[1].split("```", 1)[0]


def test_readme_snippet_evaluates_and_renders(
    run_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(run_dir.parent.parent)  # where runs/cartpole-ppo is
    code = readme_snippet()
    assert 'load_policy("runs/cartpole-ppo")' in code and "policy.predict(obs" in code
    scope: dict[str, object] = {}
    exec(compile(code, "README.md", "exec"), scope)
    assert capsys.readouterr().out.startswith("return ")
    frame = scope["frame"]
    assert isinstance(frame, np.ndarray) and frame.ndim == 3 and frame.shape[2] == 3
    assert float(scope["total"]) >= 1.0 and scope["done"]


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
