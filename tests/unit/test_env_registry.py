"""env_server.registry: gymnasium ids, `rlfleet.envs` plugins of each kind, envs named by
reference (module or file), and clashes.

Plugin entry points are faked through services.registry's `_entry_points` seam; their targets
are real objects in this module.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from importlib.metadata import EntryPoint
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
from pydantic import ValidationError

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
    with pytest.raises(InvalidArgument, match="CartPole-v1: argument no_such_kwarg=1") as err:
        registry.make_env("CartPole-v1", kwargs={"no_such_kwarg": 1})
    assert err.value.field == "create.kwargs.no_such_kwarg"


def test_kwargs_the_constructor_refuses_are_invalid_argument_naming_them() -> None:
    with pytest.raises(InvalidArgument) as err:
        registry.make_env("CartPole-v1", kwargs={"max_episode_steps": -5})
    assert str(err.value).startswith(
        "CartPole-v1: argument max_episode_steps=-5 rejected: ValueError: Expect the "
    )
    assert err.value.field == "create.kwargs.max_episode_steps"
    with pytest.raises(InvalidArgument, match="Snake-v0: argument size=640 rejected") as err:
        registry.make_env("Snake-v0", kwargs={"size": 640})
    assert err.value.field == "create.kwargs.size"
    # gymnasium lists every kwarg after the reason: only the one the reason names is blamed
    with pytest.raises(InvalidArgument, match=r"argument bad=1 rejected: TypeError") as err:
        registry.make_env("Snake-v0", kwargs={"size": 8, "bad": 1})
    assert err.value.field == "create.kwargs.bad"


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


# --- envs named by reference in a run file ----------------------------------------------------

ROOT = Path(__file__).resolve().parents[2]
MODULE = "tests.plugins.envs_plugin"


@pytest.fixture
def references(monkeypatch: pytest.MonkeyPatch) -> dict[str, object]:
    """A registry of references of this test's own (they are process-wide otherwise)."""
    fresh: dict[str, object] = {}
    monkeypatch.setattr(registry, "_REFERENCES", fresh)
    return fresh


def test_module_references_register_and_make_each_kind(references: dict[str, object]) -> None:
    entry = registry.register(f"{MODULE}:Coin")
    assert entry == registry.EnvEntry(f"{MODULE}:Coin", f"reference:module {MODULE}")
    env = registry.make_env(f"{MODULE}:Coin", kwargs={"value": 0.25}, render_mode="ansi")
    assert env.reset()[0].tolist() == [0.25] and env.render_mode == "ansi"
    registry.register(f"{MODULE}:make_coin")
    assert registry.make_env(f"{MODULE}:make_coin").step(1)[1] == 1.0
    # An id the module registers on import, aliased by "module:Id" (and listed with its spec).
    alias = registry.register(f"{MODULE}:RlfleetTestsCoin-v0")
    assert alias.max_episode_steps == 7
    assert registry.make_env(f"{MODULE}:RlfleetTestsCoin-v0").spec.id == "RlfleetTestsCoin-v0"
    listed = [e.env_id for e in registry.list_local_envs("envs_plugin")]
    assert listed == sorted(f"{MODULE}:{n}" for n in ("Coin", "make_coin", "RlfleetTestsCoin-v0"))
    # Only registered references are served: a client cannot make a server import a module.
    with pytest.raises(NotFound, match="unknown env id"):
        registry.find_env(f"{MODULE}:NotRegistered")


@pytest.mark.parametrize("example", ["agent_openenv", "agent_custom_env", "agent_guess"])
def test_an_env_jobs_env_server_starts_with_the_env_and_arguments_of_the_job(
    example: str, references: dict[str, object], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The job's env server create-checks its env at start with the job's kwargs: an env that
    needs an argument (OpenEnvText-v0's ``env``) starts, and a file reference is registered."""
    import yaml

    from env_server.service import EnvServerSettings
    from learner.lm.jobs import LM_JOBS, expand

    monkeypatch.chdir(ROOT)
    job = yaml.safe_load((ROOT / "examples" / f"{example}.yaml").read_text())["job"]
    settings = LM_JOBS[job.pop("kind")].settings.model_validate(job)
    (entry,) = [e for e in expand(settings, "r") if e["service"] == "env_server"]
    server = EnvServerSettings.model_validate(entry["settings"])
    registry.preload(*server.preload_ids())
    env_id = job["env"]["env_id"]
    env = registry.make_text_env(env_id, kwargs=job["env"]["kwargs"])
    assert env.reset(seed=0)[0]  # an opening
    with pytest.raises(ConfigError, match=r"cannot create 'OpenEnvText-v0'.*'env'"):
        registry.preload(["OpenEnvText-v0"])  # without the argument it needs


def test_a_file_reference_runs_through_preload_make_and_steps(
    references: dict[str, object], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(ROOT)  # relative paths are from the current directory
    ref = "examples/custom_env.py:Corridor"
    registry.check_reference(ref)
    registry.preload([ref])  # what the env server does at its start
    assert registry.find_env(ref).source == f"reference:file {ROOT / 'examples/custom_env.py'}"
    env = registry.make_env(ref, kwargs={"length": 3})
    obs, _ = env.reset(seed=0)
    assert obs.tolist() == [0.0]
    steps = [env.step(1) for _ in range(2)]
    assert [s[0].tolist() for s in steps] == [[0.5], [1.0]]
    assert [s[1] for s in steps] == [-0.01, 1.0] and steps[-1][2]  # terminated at the exit
    registry.preload(["examples/custom_env.py:make"])
    assert registry.make_env("examples/custom_env.py:make").render() == "A......."


@pytest.mark.parametrize(
    ("ref", "message"),
    [
        (f"{MODULE}:Con", f"module {MODULE} has no attribute 'Con' and registers no gymnasium id"),
        (f"{MODULE}:Cion", "(did you mean 'Coin'?)"),
        (f"{MODULE}:NotAnEnv", "class NotAnEnv is not a gymnasium.Env or TextEnv subclass"),
        (f"{MODULE}:NUMBER", "NUMBER is a int, not a gymnasium.Env subclass, a callable"),
        ("no_such_module_xyz:Env", "cannot import module no_such_module_xyz: ModuleNotFound"),
        ("missing/envs.py:Env", "envs.py not found (relative paths are from the current"),
        (":Env", "expected 'module:Name' or 'path/to/file.py:Name'"),
    ],
)
def test_bad_references_fail_the_check_naming_them(ref: str, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)) as err:
        registry.check_reference(ref)
    assert str(err.value).startswith(f"'{ref}' — ")


def test_a_file_that_fails_to_import_and_a_factory_of_no_env(
    references: dict[str, object], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "broken.py").write_text("raise RuntimeError('boom')\n")
    with pytest.raises(ValueError, match=r"importing .*broken.py failed: RuntimeError: boom"):
        registry.check_reference("broken.py:Env")
    with pytest.raises(ConfigError, match=r"preload: env 'broken.py:Env' — importing"):
        registry.preload(["broken.py:Env"])
    with pytest.raises(ConfigError, match=r"the factory returned int, not a gymnasium\.Env"):
        registry.preload([f"{MODULE}:make_nothing"])


def test_two_files_of_one_name_are_two_modules(tmp_path: Path) -> None:
    for folder, value in (("a", 0.1), ("b", 0.2)):
        (tmp_path / folder).mkdir()
        body = f"from {MODULE} import Coin\n\ndef make():\n    return Coin({value})\n"
        (tmp_path / folder / "envs.py").write_text(body)
    makes = [registry._resolve(f"{tmp_path}/{f}/envs.py:make").target for f in ("a", "b")]
    assert [m().value for m in makes] == [0.1, 0.2]
    assert makes[0].__module__ != makes[1].__module__


def test_a_reference_named_like_an_entry_point_is_an_error(
    plugins: list[EntryPoint], references: dict[str, object]
) -> None:
    plugins.append(EntryPoint(f"{MODULE}:Coin", f"{HERE}:Constant", GROUP))
    with pytest.raises(ConfigError, match=rf"'{MODULE}:Coin' is registered twice: as plugin:"):
        registry.register(f"{MODULE}:Coin")


def test_env_server_settings_check_references_at_validation() -> None:
    from env_server.service import EnvServerSettings

    EnvServerSettings(preload=[f"{MODULE}:Coin", "flappy_bird_gymnasium:FlappyBird-v0"])
    with pytest.raises(ValidationError, match=rf"'{MODULE}:Coi' — module .* \(did you mean"):
        EnvServerSettings(preload=[f"{MODULE}:Coi"])
