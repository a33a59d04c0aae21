"""env_server.registry: gymnasium ids, `rlfleet.envs` plugins of each kind, and clashes.

Plugin entry points are faked through services.registry's `_entry_points` seam; their targets
are real objects in this module.
"""

from __future__ import annotations

from collections.abc import Iterator
from importlib.metadata import EntryPoint

import gymnasium as gym
import numpy as np
import pytest

from env_server import registry
from services import registry as service_registry
from services.errors import ConfigError, FailedPrecondition, InvalidArgument, NotFound

GROUP = registry.PLUGIN_GROUP
HERE = __name__
ALIAS = "CartPole-v1"  # an entry point whose value is a gymnasium id
SPEC = gym.spec("Pendulum-v1")  # an entry point whose value is an EnvSpec


class Constant(gym.Env):
    """A factory plugin: kwargs reach it, render_mode too."""

    observation_space = gym.spaces.Box(0.0, 1.0, (1,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def __init__(self, value: float = 0.5, render_mode: str | None = None) -> None:
        self.value, self.render_mode = value, render_mode

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return np.full(1, self.value, np.float32), {}

    def step(self, action):
        return np.full(1, self.value, np.float32), 0.0, True, False, {}


@pytest.fixture
def plugins(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[EntryPoint]]:
    entry_points = [
        EntryPoint("Constant-v0", f"{HERE}:Constant", GROUP),
        EntryPoint("Balance-v0", f"{HERE}:ALIAS", GROUP),
        EntryPoint("Swing-v0", f"{HERE}:SPEC", GROUP),
    ]
    real = service_registry._entry_points
    monkeypatch.setattr(
        service_registry,
        "_entry_points",
        lambda group: list(entry_points) if group == GROUP else real(group),
    )
    service_registry.entry_point_registry.cache_clear()
    yield entry_points
    service_registry.entry_point_registry.cache_clear()


def test_gymnasium_and_plugin_ids_are_listed(plugins: list[EntryPoint]) -> None:
    entries = {e.env_id: e for e in registry.list_local_envs()}
    assert entries["CartPole-v1"].source == "gymnasium"
    assert entries["FlappyBird-v0"].source == "gymnasium"  # registered by importing its package
    assert entries["Constant-v0"] == registry.EnvEntry("Constant-v0", "plugin:Constant-v0")
    assert entries["Balance-v0"].max_episode_steps == 500  # from the aliased gymnasium spec
    assert entries["Swing-v0"].max_episode_steps == 200
    assert list(entries) == sorted(entries)
    assert [e.env_id for e in registry.list_local_envs("CONSTANT")] == ["Constant-v0"]


def test_envs_with_missing_dependencies_are_not_listed() -> None:
    ids = {e.env_id for e in registry.list_local_envs()}
    assert "Ant-v2" not in ids  # a retired id: gymnasium only raises
    try:
        import mujoco  # noqa: F401
    except ImportError:
        assert "Ant-v5" not in ids
        with pytest.raises(FailedPrecondition, match=r"Ant-v5.*cannot be created here"):
            registry.find_env("Ant-v5")


def test_make_each_kind_of_plugin(plugins: list[EntryPoint]) -> None:
    env = registry.make_env("Constant-v0", kwargs={"value": 0.25}, render_mode="rgb_array")
    assert env.reset()[0].tolist() == [0.25] and env.render_mode == "rgb_array"
    assert registry.make_env("Balance-v0").spec.id == "CartPole-v1"
    assert registry.make_env("Swing-v0").spec.id == "Pendulum-v1"


def test_unknown_id_and_bad_kwargs() -> None:
    with pytest.raises(NotFound, match=r"unknown env id 'CartPol-v1' .*did you mean CartPole-v1"):
        registry.find_env("CartPol-v1")
    with pytest.raises(InvalidArgument, match="CartPole-v1: bad kwargs") as err:
        registry.make_env("CartPole-v1", kwargs={"no_such_kwarg": 1})
    assert err.value.field == "create.kwargs"


def test_a_plugin_named_like_a_gymnasium_id_is_an_error(plugins: list[EntryPoint]) -> None:
    plugins.append(EntryPoint("CartPole-v1", f"{HERE}:Constant", GROUP))
    with pytest.raises(ConfigError, match="'CartPole-v1' is registered twice"):
        registry.list_local_envs()


def test_the_same_name_twice_in_the_group_is_an_error(plugins: list[EntryPoint]) -> None:
    plugins.append(EntryPoint("Constant-v0", f"{HERE}:SPEC", GROUP))
    with pytest.raises(ConfigError, match="'Constant-v0' is registered twice"):
        registry.list_local_envs()


def test_preload_checks_ids_at_start() -> None:
    registry.preload(["CartPole-v1", "flappy_bird_gymnasium:FlappyBird-v0"])
    with pytest.raises(ConfigError, match="preload: cannot create 'NoSuchEnv-v0'"):
        registry.preload(["NoSuchEnv-v0"])
