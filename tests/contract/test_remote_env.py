"""RemoteEnv / RemoteVectorEnv against `rlfleet serve env_server` in its own process.

A remote env must be usable wherever a local one is: RemoteEnv passes gymnasium's check_env
(render and close checks included: its spec makes another RemoteEnv on the same server), and
RemoteVectorEnv matches SyncVectorEnv step for step (observations, rewards and their dtype, flags,
autoreset final observations), runs under gymnasium's vector wrappers, and raises the exceptions
gymnasium users catch.
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env
from gymnasium.vector import AutoresetMode

from clients.env import (
    ClosedEnvError,
    InvalidActionError,
    RemoteAttributeError,
    RemoteEnv,
    RemoteVectorEnv,
    ResetNeededError,
)
from services.errors import FailedPrecondition, InvalidArgument, NotFound
from tests.fixtures.env_server import served_env_server

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def address() -> Iterator[str]:
    with served_env_server() as served:
        yield served


def _check_env_warnings(env: gym.Env) -> set[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check_env(env)
    return {str(w.message) for w in caught}


@pytest.mark.parametrize("env_id", ["CartPole-v1", "Pendulum-v1"])
@pytest.mark.parametrize("render_mode", [None, "rgb_array"])
def test_remote_env_passes_check_env(address: str, env_id: str, render_mode: str | None) -> None:
    env = RemoteEnv(address, env_id, render_mode=render_mode)
    try:
        remote = _check_env_warnings(env)
    finally:
        env.close()
    # No warning beyond what check_env says about the same env run locally (its spaces).
    assert remote <= _check_env_warnings(gym.make(env_id, render_mode=render_mode).unwrapped)


def test_remote_env_spec_and_metadata(address: str) -> None:
    env = RemoteEnv(address, "CartPole-v1")
    try:
        local = gym.make("CartPole-v1")
        assert local.spec is not None
        assert env.spec is not None and env.spec.id == "CartPole-v1"
        assert env.spec.max_episode_steps == local.spec.max_episode_steps == 500
        assert env.spec.reward_threshold == local.spec.reward_threshold
        assert env.metadata == {"render_modes": ["rgb_array"], "render_fps": 50}
        made = gym.make(env.spec)  # another RemoteEnv on the same server, with TimeLimit
        try:
            assert isinstance(made.unwrapped, RemoteEnv)
            np.testing.assert_array_equal(made.reset(seed=3)[0], local.reset(seed=3)[0])
        finally:
            made.close()
        with pytest.raises(ResetNeededError) as err:
            env.step(0)  # before reset
        assert isinstance(err.value, gym.error.ResetNeeded | FailedPrecondition)
    finally:
        env.close()
    env.close()  # idempotent
    with pytest.raises(gym.error.ClosedEnvironmentError):
        env.reset()


def test_remote_env_is_seeded_like_a_local_env(address: str) -> None:
    env, local = RemoteEnv(address, "CartPole-v1"), gym.make("CartPole-v1")
    try:
        obs, info = env.reset(seed=123)
        np.testing.assert_array_equal(obs, local.reset(seed=123)[0])
        assert info == {}
        for action in [0, 1, 1, 0, np.int64(1)]:
            got, want = env.step(action), local.step(action)
            np.testing.assert_array_equal(got[0], want[0])
            assert got[1:4] == want[1:4] and isinstance(got[1], float)
        np.testing.assert_array_equal(env.reset(seed=123)[0], obs)
    finally:
        env.close()


def test_remote_env_has_no_autoreset(address: str) -> None:
    env = RemoteEnv(address, "CartPole-v1")
    try:
        env.reset(seed=0)
        terminated = False
        while not terminated:
            _, _, terminated, _, _ = env.step(1)
        with pytest.raises(FailedPrecondition, match="reset them before stepping") as err:
            env.step(1)
        assert isinstance(err.value, gym.error.ResetNeeded)
        env.reset()
        env.step(0)
    finally:
        env.close()


def _sync(n: int, mode: AutoresetMode) -> gym.vector.SyncVectorEnv:
    return gym.vector.SyncVectorEnv([lambda: gym.make("CartPole-v1")] * n, autoreset_mode=mode)


def _sync_of(env_id: str, n: int, mode: AutoresetMode) -> gym.vector.SyncVectorEnv:
    return gym.vector.SyncVectorEnv([lambda: gym.make(env_id)] * n, autoreset_mode=mode)


def test_remote_vector_env_defaults_like_sync_vector_env(address: str) -> None:
    remote, local = RemoteVectorEnv(address, "CartPole-v1", 2), _sync(2, AutoresetMode.NEXT_STEP)
    try:
        assert remote.metadata["autoreset_mode"] is local.metadata["autoreset_mode"]
        assert remote.autoreset_mode is AutoresetMode.NEXT_STEP
        assert remote.metadata["render_fps"] == local.metadata["render_fps"]
        assert set(remote.metadata["render_modes"]) <= set(local.metadata["render_modes"])
        spec = gym.make("CartPole-v1").spec  # SyncVectorEnv made by hand has none
        assert remote.spec is not None and spec is not None and remote.spec.id == spec.id
        assert remote.spec.max_episode_steps == spec.max_episode_steps
        assert repr(remote) == "RemoteVectorEnv(CartPole-v1, num_envs=2)"
    finally:
        remote.close()
        local.close()


@pytest.mark.parametrize(
    ("env_id", "steps"), [("CartPole-v1", 150), ("Pendulum-v1", 210)], ids=["cartpole", "pendulum"]
)
@pytest.mark.parametrize("seed", [42, [7, 3, 3, 0, 11]], ids=["int-seed", "list-seeds"])
@pytest.mark.parametrize("mode", [AutoresetMode.SAME_STEP, AutoresetMode.NEXT_STEP])
def test_remote_vector_env_matches_sync_vector_env(
    address: str, mode: AutoresetMode, seed: int | list[int | None], env_id: str, steps: int
) -> None:
    n = 5
    remote = RemoteVectorEnv(address, env_id, n, autoreset_mode=mode)
    local = _sync_of(env_id, n, mode)
    try:
        assert remote.num_envs == n
        assert remote.single_observation_space == local.single_observation_space
        assert remote.observation_space == local.observation_space
        assert remote.single_action_space == local.single_action_space
        assert remote.action_space == local.action_space
        assert remote.metadata["autoreset_mode"] == mode
        r_obs, r_info = remote.reset(seed=seed)
        l_obs, l_info = local.reset(seed=seed)
        np.testing.assert_array_equal(r_obs, l_obs)
        assert r_info == l_info == {}
        local.action_space.seed(0)
        actions = [local.action_space.sample() for _ in range(steps)]
        autoresets = 0
        for a in actions:
            r_obs, r_rew, r_term, r_trunc, r_info = remote.step(a)
            l_obs, l_rew, l_term, l_trunc, l_info = local.step(a)
            np.testing.assert_array_equal(r_obs, l_obs)
            assert r_obs.flags.writeable and r_rew.dtype == l_rew.dtype == np.float64
            np.testing.assert_array_equal(r_rew, l_rew)  # exact: float64 on the wire
            np.testing.assert_array_equal(r_term, l_term)
            np.testing.assert_array_equal(r_trunc, l_trunc)
            assert r_term.dtype == r_trunc.dtype == np.bool_
            assert sorted(r_info) == sorted(l_info)
            if "final_obs" in l_info:
                autoresets += 1
                np.testing.assert_array_equal(r_info["_final_obs"], l_info["_final_obs"])
                np.testing.assert_array_equal(r_info["_final_info"], l_info["_final_info"])
                assert r_info["final_info"] == l_info["final_info"] == {}
                for i in np.flatnonzero(l_info["_final_obs"]):
                    np.testing.assert_array_equal(r_info["final_obs"][i], l_info["final_obs"][i])
                assert all(r_info["final_obs"][~l_info["_final_obs"]] == None)  # noqa: E711
            assert [e.env_index for e in remote.last_episodes] == np.flatnonzero(
                l_term | l_trunc
            ).tolist()
        assert mode is AutoresetMode.NEXT_STEP or autoresets > 0
    finally:
        remote.close()
        local.close()


def test_list_seeds_with_none_and_reset_mask(address: str) -> None:
    remote, local = RemoteVectorEnv(address, "CartPole-v1", 3), _sync(3, AutoresetMode.NEXT_STEP)
    try:
        r_obs, _ = remote.reset(seed=[1, None, 5])
        l_obs, _ = local.reset(seed=[1, None, 5])
        np.testing.assert_array_equal(r_obs[[0, 2]], l_obs[[0, 2]])  # env 1: unseeded
        mask = np.array([False, True, True])
        r_obs, _ = remote.reset(seed=[None, 4, 8], options={"reset_mask": mask})
        l_obs, _ = local.reset(seed=[None, 4, 8], options={"reset_mask": mask})
        np.testing.assert_array_equal(r_obs[1:], l_obs[1:])
        np.testing.assert_array_equal(remote.reset(seed=(2, 2, 2))[0], local.reset(seed=[2] * 3)[0])
        with pytest.raises(ValueError, match="length must match num_envs=3"):
            remote.reset(seed=[1, 2])
        with pytest.raises(InvalidArgument, match="seeds must be >= 0"):
            remote.reset(seed=[1, -2, 3])
    finally:
        remote.close()
        local.close()


def test_reset_mask_resets_only_those_envs(address: str) -> None:
    remote, local = RemoteVectorEnv(address, "CartPole-v1", 3), _sync(3, AutoresetMode.NEXT_STEP)
    try:
        remote.reset(seed=1), local.reset(seed=1)
        for _ in range(3):
            remote.step(np.ones(3, np.int64)), local.step(np.ones(3, np.int64))
        mask = np.array([True, False, True])
        r_obs, _ = remote.reset(seed=9, options={"reset_mask": mask})
        l_obs, _ = local.reset(seed=9, options={"reset_mask": mask})
        np.testing.assert_array_equal(r_obs, l_obs)
    finally:
        remote.close()
        local.close()


def test_server_errors_surface_as_rlfleet_errors(address: str) -> None:
    with pytest.raises(NotFound, match="unknown env id 'NoSuchEnv-v0'"):
        RemoteVectorEnv(address, "NoSuchEnv-v0", 2)
    envs = RemoteVectorEnv(address, "CartPole-v1", 2)
    try:
        with pytest.raises(gym.error.ResetNeeded, match="step before reset") as needed:
            envs.step(np.zeros(2, np.int64))
        assert isinstance(needed.value, ResetNeededError | FailedPrecondition)
        envs.reset(seed=0)
        with pytest.raises(InvalidArgument, match=r"expected shape \[2\]") as err:
            envs.step(np.zeros(3, np.int64))
        assert err.value.field == "actions"
        assert isinstance(err.value, InvalidActionError | gym.error.InvalidAction | ValueError)
        assert isinstance(err.value, gym.error.InvalidAction) and isinstance(err.value, ValueError)
        with pytest.raises(ValueError, match=r"value 2 is outside \[0, 1\]"):
            envs.step(np.array([0, 2]))
        envs.step(np.zeros(2, np.int64))
    finally:
        envs.close()
    envs.close()  # idempotent
    with pytest.raises(gym.error.ClosedEnvironmentError) as closed:
        envs.step(np.zeros(2, np.int64))
    assert isinstance(closed.value, ClosedEnvError | FailedPrecondition)


def test_get_attr_call_set_attr(address: str) -> None:
    envs = RemoteVectorEnv(address, "CartPole-v1", 2, render_mode="rgb_array")
    local = gym.make("CartPole-v1", render_mode="rgb_array")
    try:
        envs.reset(seed=0), local.reset(seed=0)
        assert envs.get_attr("render_mode") == ("rgb_array", "rgb_array")
        assert envs.get_attr("observation_space") == (local.observation_space,) * 2
        assert envs.call("action_space") == (local.action_space,) * 2
        assert envs.get_attr("spec")[0].id == "CartPole-v1"
        assert envs.get_attr("metadata")[0] == {"render_modes": ["rgb_array"], "render_fps": 50}
        frames = envs.call("render")
        want = np.asarray(local.render())
        assert len(frames) == 2 and frames[0].shape == want.shape
        np.testing.assert_array_equal(frames[0], want)
        with pytest.raises(AttributeError, match="'gravity'") as err:
            envs.get_attr("gravity")
        assert isinstance(err.value, RemoteAttributeError)
        with pytest.raises(AttributeError):
            envs.call("step", 0)
        with pytest.raises(ValueError, match="Got `3` values for 2 environments"):
            envs.set_attr("gravity", [1.0, 2.0, 3.0])
        with pytest.raises(AttributeError, match="cannot be set"):
            envs.set_attr("gravity", 1.0)
    finally:
        envs.close()
        local.close()
    plain = RemoteVectorEnv(address, "CartPole-v1", 2)
    try:
        assert plain.call("render") == (None, None) and plain.render() is None
    finally:
        plain.close()


@pytest.mark.parametrize("mode", [AutoresetMode.SAME_STEP, AutoresetMode.NEXT_STEP])
def test_gymnasium_vector_wrappers_match_on_sync_vector_env(
    address: str, mode: AutoresetMode
) -> None:
    """The same wrapper stack over RemoteVectorEnv and SyncVectorEnv gives the same numbers."""
    from gymnasium.wrappers import vector as vw

    def wrap(envs: gym.vector.VectorEnv) -> gym.vector.VectorEnv:
        envs = vw.RecordEpisodeStatistics(envs)
        envs = vw.ClipAction(envs)
        if mode is AutoresetMode.NEXT_STEP:  # observation wrappers take NEXT_STEP only
            envs = vw.NormalizeObservation(envs)
            envs = vw.TransformObservation(envs, lambda o: o * 2.0)
        envs = vw.NormalizeReward(envs)
        return vw.TransformReward(envs, lambda r: np.clip(r, -5, 5))

    n = 3
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. a missing autoreset_mode tag
        remote = wrap(RemoteVectorEnv(address, "Pendulum-v1", n, autoreset_mode=mode))
        local = wrap(_sync_of("Pendulum-v1", n, mode))
    try:
        r_obs, _ = remote.reset(seed=5)
        l_obs, _ = local.reset(seed=5)
        np.testing.assert_allclose(r_obs, l_obs)
        local.action_space.seed(1)
        episodes = 0
        for _ in range(205):
            action = local.action_space.sample() * 3.0  # out of bounds: ClipAction clips
            r_obs, r_rew, _, r_trunc, r_info = remote.step(action)
            l_obs, l_rew, _, l_trunc, l_info = local.step(action)
            np.testing.assert_allclose(r_obs, l_obs)
            np.testing.assert_allclose(r_rew, l_rew)
            np.testing.assert_array_equal(r_trunc, l_trunc)
            if "episode" in l_info:
                episodes += 1
                np.testing.assert_array_equal(r_info["_episode"], l_info["_episode"])
                for key in ("r", "l"):
                    np.testing.assert_allclose(r_info["episode"][key], l_info["episode"][key])
        assert episodes > 0
    finally:
        remote.close()
        local.close()


def test_close_prints_nothing(tmp_path: Path, address: str) -> None:
    script = tmp_path / "close.py"
    script.write_text(
        "import warnings, numpy as np\n"
        "warnings.simplefilter('always')\n"
        "from clients.env import RemoteEnv, RemoteVectorEnv\n"
        f"address = {address!r}\n"
        "for k in range(6):\n"
        "    env = RemoteEnv(address, 'CartPole-v1') if k % 2 else "
        "RemoteVectorEnv(address, 'CartPole-v1', 2)\n"
        "    env.reset(seed=k)\n"
        "    try:\n"
        "        env.step(5 if k % 2 else np.array([5, 5]))\n"
        "    except ValueError:\n"
        "        pass\n"
        "    env.close()\n"
        "    env.close()\n"
        "import time; time.sleep(0.3)\n"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONDEVMODE": "1"}
    done = subprocess.run(
        [sys.executable, str(script)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == done.stderr == ""


def test_rlfleet_envs_lists_the_servers_envs(address: str) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "launch.cli", "envs", "--server", address],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    rows = {line.split()[0] for line in out.splitlines()[1:]}
    assert {"CartPole-v1", "FlappyBird-v0"} <= rows
