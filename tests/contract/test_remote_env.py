"""RemoteEnv / RemoteVectorEnv against `rlfleet serve env_server` in its own process.

A remote env must be usable wherever a local one is: RemoteEnv passes gymnasium's check_env, and
RemoteVectorEnv matches SyncVectorEnv step for step (observations, rewards, flags, autoreset
final observations). check_env's render checks are skipped (skip_render_check=True): they build
extra envs locally through env.spec.make(render_mode=...), and a RemoteEnv has no local spec to
make. For the same reason check_env's seeded-determinism asserts, which it only runs when
env.spec is set, are done here directly.
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

from env_server.client import RemoteEnv, RemoteVectorEnv
from services.errors import FailedPrecondition, InvalidArgument, NotFound
from services.ports import free_port
from services.server import wait_for_health

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def address() -> Iterator[str]:
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RLFLEET_LOG_LEVEL": "WARNING"}
    cmd = [sys.executable, "-m", "services.cli", "serve", "env_server", "--port", str(port)]
    server = subprocess.Popen(cmd, cwd=REPO, env=env)
    try:
        wait_for_health(f"127.0.0.1:{port}", timeout_s=60)
        yield f"127.0.0.1:{port}"
    finally:
        server.terminate()
        assert server.wait(timeout=30) == 0


def _check_env_warnings(env: gym.Env) -> set[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check_env(env, skip_render_check=True)
    return {str(w.message) for w in caught}


@pytest.mark.parametrize("env_id", ["CartPole-v1", "Pendulum-v1"])
def test_remote_env_passes_check_env(address: str, env_id: str) -> None:
    env = RemoteEnv(address, env_id)
    try:
        remote = _check_env_warnings(env)
    finally:
        env.close()
    # No warning beyond what check_env says about the same env run locally (its spaces).
    assert remote <= _check_env_warnings(gym.make(env_id).unwrapped)


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
        with pytest.raises(FailedPrecondition, match="reset them before stepping"):
            env.step(1)
        env.reset()
        env.step(0)
    finally:
        env.close()


def _sync(n: int, mode: AutoresetMode) -> gym.vector.SyncVectorEnv:
    return gym.vector.SyncVectorEnv([lambda: gym.make("CartPole-v1")] * n, autoreset_mode=mode)


@pytest.mark.parametrize("mode", [AutoresetMode.SAME_STEP, AutoresetMode.NEXT_STEP])
def test_remote_vector_env_matches_sync_vector_env(address: str, mode: AutoresetMode) -> None:
    n, seed = 5, 42
    remote, local = RemoteVectorEnv(address, "CartPole-v1", n, autoreset_mode=mode), _sync(n, mode)
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
        actions = np.random.default_rng(0).integers(0, 2, size=(150, n))
        autoresets = 0
        for a in actions:
            r_obs, r_rew, r_term, r_trunc, r_info = remote.step(a)
            l_obs, l_rew, l_term, l_trunc, l_info = local.step(a)
            np.testing.assert_array_equal(r_obs, l_obs)
            assert r_obs.flags.writeable and r_rew.dtype == l_rew.dtype == np.float64
            np.testing.assert_array_equal(r_rew, l_rew)
            np.testing.assert_array_equal(r_term, l_term)
            np.testing.assert_array_equal(r_trunc, l_trunc)
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


def test_reset_mask_resets_only_those_envs(address: str) -> None:
    remote, local = RemoteVectorEnv(address, "CartPole-v1", 3), _sync(3, AutoresetMode.SAME_STEP)
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
        envs.reset(seed=0)
        with pytest.raises(InvalidArgument, match=r"expected shape \[2\]") as err:
            envs.step(np.zeros(3, np.int64))
        assert err.value.field == "actions"
        envs.step(np.zeros(2, np.int64))
    finally:
        envs.close()


def test_rlfleet_envs_lists_the_servers_envs(address: str) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "services.cli", "envs", "--server", address],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    rows = {line.split()[0] for line in out.splitlines()[1:]}
    assert {"CartPole-v1", "FlappyBird-v0"} <= rows
