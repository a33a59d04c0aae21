"""RemoteVectorEnv where gymnasium users' training scripts meet it, against a real env server.

- ``record_episode_statistics=True`` gives the infos a per-env ``RecordEpisodeStatistics``
  wrapper gives under SyncVectorEnv (the wrapper of a CleanRL env factory never reaches the
  server), in both autoreset modes, over gRPC and over the co-located ring: CleanRL's
  gymnasium-1.x loop (``infos["final_info"]["_episode"]`` under SAME_STEP, ``infos["_episode"]``
  under NEXT_STEP) reads the same episodes from both;
- unknown env ids and bad seeds raise what gymnasium raises locally for the same input.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.vector import AutoresetMode

from clients.env import RemoteVectorEnv
from services.errors import InvalidArgument, NotFound
from tests.fixtures.env_server import served_env_server


@pytest.fixture(scope="module")
def address() -> Iterator[str]:
    with served_env_server() as served:
        yield served


def _local(n: int, mode: AutoresetMode) -> gym.vector.SyncVectorEnv:
    """CleanRL's env factory: the statistics wrapper inside each env."""
    factory = lambda: gym.wrappers.RecordEpisodeStatistics(gym.make("CartPole-v1"))  # noqa: E731
    return gym.vector.SyncVectorEnv([factory] * n, autoreset_mode=mode)


def _cleanrl_episodes(infos: dict[str, Any], mode: AutoresetMode) -> list[tuple[float, int]]:
    """What CleanRL's gymnasium-1.x scripts read from one step's infos."""
    if mode is AutoresetMode.SAME_STEP:
        if "final_info" not in infos:
            return []
        stats, mask = infos["final_info"]["episode"], infos["final_info"]["_episode"]
    else:
        if "episode" not in infos:
            return []
        stats, mask = infos["episode"], infos["_episode"]
    over = np.nonzero(mask)[0]
    return list(zip(stats["r"][over].tolist(), stats["l"][over].tolist(), strict=True))


def _same_layout(remote: Any, local: Any, path: str = "infos") -> None:
    """Same keys, masks and array dtypes at every level; equal values but the wall times."""
    assert isinstance(remote, dict) and sorted(remote) == sorted(local), path
    for key, value in local.items():
        where = f"{path}[{key!r}]"
        if isinstance(value, dict):
            _same_layout(remote[key], value, where)
        elif key == "final_obs":
            assert remote[key].dtype == value.dtype == object, where
        elif key == "t":
            assert remote[key].dtype == value.dtype == np.float64, where
            assert (remote[key] >= 0).all() and (remote[key][~local["_t"]] == 0).all(), where
        else:
            assert remote[key].dtype == value.dtype, where
            np.testing.assert_array_equal(remote[key], value, err_msg=where)


@pytest.mark.parametrize("colocated", [False, True], ids=["grpc", "shm"])
@pytest.mark.parametrize("mode", [AutoresetMode.SAME_STEP, AutoresetMode.NEXT_STEP])
def test_cleanrl_loop_reads_episode_statistics(
    address: str, mode: AutoresetMode, colocated: bool
) -> None:
    n = 4
    remote = RemoteVectorEnv(
        address, "CartPole-v1", n, autoreset_mode=mode, record_episode_statistics=True,
        colocated=colocated,
    )  # fmt: skip
    local = _local(n, mode)
    try:
        assert remote.transport == ("shm" if colocated else "grpc"), remote.colocate_reason
        remote.reset(seed=11)
        local.reset(seed=11)
        local.action_space.seed(0)
        got: list[tuple[float, int]] = []
        want: list[tuple[float, int]] = []
        for _ in range(120):
            action = local.action_space.sample()
            *_, r_infos = remote.step(action)
            *_, l_infos = local.step(action)
            _same_layout(r_infos, l_infos)
            got += _cleanrl_episodes(r_infos, mode)
            want += _cleanrl_episodes(l_infos, mode)
        assert len(want) >= n and got == want
    finally:
        remote.close()
        local.close()


def test_without_the_option_infos_stay_the_servers(address: str) -> None:
    """Off by default: infos are what the server sent (SyncVectorEnv's without wrappers)."""
    remote = RemoteVectorEnv(address, "CartPole-v1", 2, autoreset_mode=AutoresetMode.NEXT_STEP)
    try:
        remote.reset(seed=0)
        for _ in range(60):
            *_, infos = remote.step(np.array([0, 0]))
            assert infos == {}
    finally:
        remote.close()


def _raised(call: Any) -> BaseException:
    try:
        call()
    except Exception as exc:
        return exc
    raise AssertionError("no exception")


BAD_SEEDS = ["abc", "ab", 1.5, -1, [1, "a"], [1.5, 2], [-1, 2], np.float64(2.0), {"a": 1}, b"x"]


def test_bad_seeds_and_unknown_ids_raise_what_gymnasium_raises(address: str) -> None:
    remote = RemoteVectorEnv(address, "CartPole-v1", 2)
    local = gym.vector.SyncVectorEnv([lambda: gym.make("CartPole-v1")] * 2)
    try:
        for seed in BAD_SEEDS:
            expected = type(_raised(lambda s=seed: local.reset(seed=s)))
            error = _raised(lambda s=seed: remote.reset(seed=s))
            assert isinstance(error, expected), (seed, type(error), expected)
            if isinstance(error, gym.error.Error):
                assert isinstance(error, InvalidArgument) and error.field == "seed"
        remote.reset(seed=[3, None])  # still usable
    finally:
        remote.close()
        local.close()
    for env_id in ("NoSuchEnv-v0", "CartPole-v9"):
        with pytest.raises(gym.error.UnregisteredEnv):
            gym.make_vec(env_id, 2)
        with pytest.raises(gym.error.NameNotFound) as err:
            RemoteVectorEnv(address, env_id, 2)
        assert isinstance(err.value, NotFound) and f"unknown env id '{env_id}'" in str(err.value)
