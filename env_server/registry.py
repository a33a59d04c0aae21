"""Which environments this machine can create, and how to create one.

Two sources, one namespace of ids:
- the gymnasium registry (CartPole-v1, ...), including packages that register their ids when
  imported (flappy_bird_gymnasium); see GYMNASIUM_PLUGIN_MODULES;
- the `rlfleet.envs` entry-point group: the entry point's name is the env id, its value either a
  callable factory (`factory(render_mode=..., **kwargs) -> gymnasium.Env`), a gymnasium id string
  (an alias, "module:Id" allowed) or a gymnasium `EnvSpec`.

An id defined by both is an error (services.registry refuses duplicates inside the group): which
one a client got would depend on import order.

A run file may also name an env by reference, the reference being its id: ``module:Name`` (an
importable module) or ``path/to/file.py:Name`` (a file, relative to the current directory,
imported under a module name of its own), where ``Name`` is a gymnasium Env subclass, a callable
returning an Env (a factory, called like an entry point's) or an EnvSpec in that module, or a
gymnasium id the module registers when imported. `check_reference` imports and checks one when
the config is validated; `register` (run by `preload` at the server's start) makes it an id this
server creates, beside the others (the same id twice is an error).
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import functools
import importlib
import importlib.util
import re
import reprlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from clients.env.types import EnvEntry
from env_server.text.base import TextEnv
from env_server.text.envs import BUILTIN_TEXT_ENVS
from services.errors import ConfigError, FailedPrecondition, InvalidArgument, NotFound
from services.references import import_reference_module, is_reference, split_reference
from services.registry import entry_point_registry

if TYPE_CHECKING:
    import gymnasium

__all__ = [
    "GYMNASIUM_PLUGIN_MODULES",
    "PLUGIN_GROUP",
    "check_reference",
    "env_catalog",
    "find_env",
    "is_reference",
    "list_local_envs",
    "make_env",
    "make_text_env",
    "preload",
    "register",
]

PLUGIN_GROUP = "rlfleet.envs"
# Packages whose import registers gymnasium ids (gymnasium 1.x has no plugin discovery of its
# own). Imported when installed; more can be named per server with the `preload` setting.
GYMNASIUM_PLUGIN_MODULES = ("flappy_bird_gymnasium", "env_server.envs")  # envs: Snake-v0


@functools.cache
def _gymnasium() -> Any:
    """gymnasium, with the ids of GYMNASIUM_PLUGIN_MODULES registered (imported once)."""
    import gymnasium

    for module in GYMNASIUM_PLUGIN_MODULES:
        if importlib.util.find_spec(module) is not None:
            importlib.import_module(module)
    return gymnasium


def _gym_entry(spec: Any, source: str, env_id: str | None = None) -> EnvEntry:
    return EnvEntry(
        env_id=env_id or spec.id,
        source=source,
        max_episode_steps=spec.max_episode_steps or 0,
        reward_threshold=spec.reward_threshold,
    )


def _plugin_entries(registry: dict[str, Any]) -> dict[str, EnvEntry]:
    plugins = entry_point_registry(PLUGIN_GROUP)
    entries = {}
    for name in plugins:
        if name in registry and not _is_same_registration(plugins[name], registry[name]):
            raise ConfigError(
                f"env id '{name}' is registered twice: in gymnasium and as entry point "
                f"'{plugins.target(name)}' of group '{PLUGIN_GROUP}'"
            )
        value, source = plugins[name], f"plugin:{name}"
        if _is_text_env(value):
            entries[name] = EnvEntry(name, source, kind="text")
            continue
        spec = _spec_of(value, registry)
        entries[name] = _gym_entry(spec, source, name) if spec else EnvEntry(name, source)
    return entries


def _is_same_registration(value: Any, spec: Any) -> bool:
    """A plugin may expose its own gymnasium registration under its own id: not a clash."""
    return value is spec or (isinstance(value, str) and value == spec.id)


def _spec_of(value: Any, registry: dict[str, Any]) -> Any:
    """The gymnasium EnvSpec behind a plugin value, or None for a plain factory."""
    from gymnasium.envs.registration import EnvSpec

    if isinstance(value, EnvSpec):
        return value
    if isinstance(value, str):
        module, _, env_id = value.rpartition(":")
        if module:
            importlib.import_module(module)
        if env_id not in registry:
            raise ConfigError(f"'{PLUGIN_GROUP}' alias points at unknown gymnasium id '{value}'")
        return registry[env_id]
    if callable(value):
        return None
    raise ConfigError(
        f"'{PLUGIN_GROUP}' entries must be a callable, a gymnasium id or an EnvSpec; "
        f"got {type(value).__name__}"
    )


@functools.cache
def _unavailable(entry_point: Any) -> str | None:
    """Why a gymnasium entry point cannot be loaded here (a missing extra such as MuJoCo, Box2D
    or jax), or None. Importing its module is the check (cached, so once per entry point)."""
    if entry_point is None:
        return "no entry point"
    if not isinstance(entry_point, str):
        # gymnasium registers retired ids (Ant-v2, GymV21Environment-v0) with placeholder
        # functions `_raise_*_error` that only raise an ImportError explaining the move.
        name = getattr(entry_point, "__name__", "")
        return "retired id (gymnasium only raises)" if name.startswith("_raise_") else None
    try:
        importlib.import_module(entry_point.partition(":")[0])
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


# --- references from the run file --------------------------------------------------------------

REFERENCE_FORMS = "'module:Name' or 'path/to/file.py:Name'"


@dataclass(frozen=True)
class _Reference:
    target: Any  # an Env subclass, a factory or an EnvSpec
    origin: str  # "file /abs/envs.py" or "module pkg.envs", for errors and ListEnvs


_REFERENCES: dict[str, _Reference] = {}  # registered by this server (see `register`)


def _resolve(ref: str) -> _Reference:
    """What a reference names; ValueError saying what is wrong."""
    import gymnasium
    from gymnasium.envs.registration import EnvSpec

    where, name = split_reference(ref, REFERENCE_FORMS)
    module, label, origin = import_reference_module(where)
    registry = _gymnasium().registry
    if not hasattr(module, name):
        if name in registry:  # an id the module registered on import
            return _Reference(registry[name], origin)
        names = [n for n in vars(module) if not n.startswith("_")] + list(registry)
        close = difflib.get_close_matches(name, names, n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        raise ValueError(
            f"module {label} has no attribute '{name}' and registers no gymnasium id '{name}'"
            + hint
        )
    target = getattr(module, name)
    if isinstance(target, type) and not issubclass(target, gymnasium.Env | TextEnv):
        raise ValueError(f"class {name} is not a gymnasium.Env or TextEnv subclass")
    if not (callable(target) or isinstance(target, EnvSpec)):
        raise ValueError(
            f"{name} is a {type(target).__name__}, not a gymnasium.Env subclass, a callable "
            "returning one or an EnvSpec"
        )
    return _Reference(target, origin)


def check_reference(ref: str) -> None:
    """Import and check a reference at config-load time; ValueError ``'<ref>' — <reason>``.

    A factory is only known to return an Env once called: `preload` creates one at start."""
    try:
        _resolve(ref)
    except ValueError as exc:
        raise ValueError(f"'{ref}' — {exc}") from None


def register(ref: str) -> EnvEntry:
    """Make ``ref`` an env id of this process (idempotent); ConfigError when it does not
    resolve or clashes with a gymnasium id or an entry point of the same name."""
    if ref not in _REFERENCES:
        try:
            resolved = _resolve(ref)
        except ValueError as exc:
            raise ConfigError(f"env '{ref}' — {exc}") from None
        others = _registered_entries()
        if ref in others:
            raise ConfigError(
                f"env id '{ref}' is registered twice: as {others[ref].source} and by reference "
                f"({resolved.origin})"
            )
        _REFERENCES[ref] = resolved
    return _reference_entries()[ref]


def _reference_entries() -> dict[str, EnvEntry]:
    from gymnasium.envs.registration import EnvSpec

    entries = {}
    for ref, resolved in _REFERENCES.items():
        source = f"reference:{resolved.origin}"
        spec = resolved.target if isinstance(resolved.target, EnvSpec) else None
        if _is_text_env(resolved.target):
            entries[ref] = EnvEntry(ref, source, kind="text")
        else:
            entries[ref] = _gym_entry(spec, source, ref) if spec else EnvEntry(ref, source)
    return entries


def _registered_entries() -> dict[str, EnvEntry]:
    gym = _gymnasium()
    registry = gym.registry
    entries = {
        env_id: _gym_entry(spec, "gymnasium")
        for env_id, spec in registry.items()
        if _unavailable(spec.entry_point) is None
    }
    entries.update(_plugin_entries(registry))
    entries.update(
        {env_id: EnvEntry(env_id, "rlfleet", kind="text") for env_id in BUILTIN_TEXT_ENVS}
    )
    return entries


def _all_entries() -> dict[str, EnvEntry]:
    return {**_registered_entries(), **_reference_entries()}


def list_local_envs(filter: str = "") -> list[EnvEntry]:
    """Env ids this process can create, sorted; `filter` is a case-insensitive substring.

    gymnasium ids whose module does not import (a missing optional dependency) are left out.
    """
    needle = filter.lower()
    return sorted(
        (e for e in _all_entries().values() if needle in e.env_id.lower()),
        key=lambda e: e.env_id,
    )


def env_catalog() -> list[dict[str, Any]]:
    """Every env id this process can create, as rows (the ``envs`` catalog of forms)."""
    return [dataclasses.asdict(e) for e in list_local_envs()]


def find_env(env_id: str) -> EnvEntry:
    """The entry for `env_id`; NotFound (with close matches) when unknown."""
    entries = _all_entries()
    if env_id in entries:
        return entries[env_id]
    gym = _gymnasium()
    if env_id in gym.registry:
        why = _unavailable(gym.registry[env_id].entry_point)
        raise FailedPrecondition(f"env id '{env_id}' cannot be created here: {why}")
    import difflib

    close = difflib.get_close_matches(env_id, list(entries), n=3)
    hint = f" (did you mean {', '.join(close)}?)" if close else ""
    raise NotFound(f"unknown env id '{env_id}'{hint}", field="create.env_id")


def make_env(
    env_id: str, *, kwargs: dict[str, Any] | None = None, render_mode: str | None = None
) -> gymnasium.Env:
    """Create one environment of a listed id.

    Bad kwargs (the env raises TypeError, or ValueError/AssertionError when it was given any)
    are InvalidArgument naming the id and the argument, a missing optional dependency
    FailedPrecondition; anything else the env raises propagates (the servicer reports it as
    INTERNAL).
    """
    entry = find_env(env_id)
    if entry.kind == "text":
        raise FailedPrecondition(f"{env_id} is a text environment: make_text_env creates it")
    gym = _gymnasium()
    kwargs = dict(kwargs or {})
    if render_mode:
        kwargs["render_mode"] = render_mode
    given = dict(kwargs)  # what the caller chose, before a target adds its own
    target: Any = env_id
    if entry.source.startswith("plugin:"):
        value = entry_point_registry(PLUGIN_GROUP)[env_id]
        target = value if not isinstance(value, str) else _spec_of(value, gym.registry)
    elif env_id in _REFERENCES:
        target = _REFERENCES[env_id].target
    try:
        if callable(target) and not isinstance(target, str):
            env = target(**kwargs)
        else:
            return gym.make(target, **kwargs)
    except TypeError as exc:
        raise _rejected(env_id, given, exc) from exc
    except (ValueError, AssertionError) as exc:
        if not given:
            raise  # the env fails on its own defaults: its bug, not the caller's
        raise _rejected(env_id, given, exc) from exc
    except gym.error.DependencyNotInstalled as exc:
        raise FailedPrecondition(f"{env_id}: {exc}") from exc
    if not isinstance(env, gym.Env):
        raise FailedPrecondition(
            f"{env_id}: the factory returned {type(env).__name__}, not a gymnasium.Env"
        )
    return env


def _is_text_env(target: Any) -> bool:
    return isinstance(target, type) and issubclass(target, TextEnv)


def make_text_env(env_id: str, *, kwargs: dict[str, Any] | None = None) -> TextEnv:
    """Create one text environment of a listed id (a built-in, an entry point or a reference
    naming a TextEnv subclass); arguments it refuses are InvalidArgument naming them."""
    entry = find_env(env_id)
    if entry.kind != "text":
        raise InvalidArgument(f"{env_id} is not a text environment", field="create.env_id")
    if env_id in BUILTIN_TEXT_ENVS:
        target: Any = BUILTIN_TEXT_ENVS[env_id]
    elif env_id in _REFERENCES:
        target = _REFERENCES[env_id].target
    else:
        target = entry_point_registry(PLUGIN_GROUP)[env_id]
    given = dict(kwargs or {})
    try:
        env = target(**given)
    except (TypeError, ValueError, AssertionError) as exc:
        if not given and not isinstance(exc, TypeError):
            raise  # the env fails on its own defaults: its bug, not the caller's
        raise _rejected(env_id, given, exc) from exc
    if not isinstance(env, TextEnv):
        raise FailedPrecondition(f"{env_id}: {type(env).__name__} is not a TextEnv")
    return env


def _rejected(env_id: str, given: dict[str, Any], exc: BaseException) -> InvalidArgument:
    """The env's constructor refused ``given``: InvalidArgument naming the id and the
    arguments its message names (else all of them), with the env's own reason."""
    reason = f"{type(exc).__name__}: {exc}"
    if not given:
        return InvalidArgument(f"{env_id}: bad kwargs: {reason}", field="create.kwargs")
    # gymnasium appends every kwarg to a constructor's TypeError: only the part before names one
    told = str(exc).partition(" was raised from the environment creator")[0]
    named = [k for k in given if re.search(rf"(?<!\w){re.escape(k)}(?!\w)", told)]
    shown = ", ".join(f"{k}={reprlib.repr(given[k])}" for k in (named or given))
    what = "argument" if len(named or given) == 1 else "arguments"
    field = f"create.kwargs.{named[0]}" if len(named) == 1 else "create.kwargs"
    return InvalidArgument(f"{env_id}: {what} {shown} rejected: {reason}", field=field)


def preload(env_ids: list[str], kwargs: Mapping[str, dict[str, Any]] | None = None) -> None:
    """Register each reference and create-check each id at server start (with its ``kwargs``,
    for an env that needs some), so a typo fails the start, not a run.

    A reference registers itself as an id; "module:Id" (how third-party gymnasium packages are
    named) is one, an alias of the id `module` registers, which the bare id names too.
    """
    for env_id in env_ids:
        if is_reference(env_id):
            try:
                register(env_id)
            except ConfigError as exc:
                raise ConfigError(f"preload: {exc}") from None
        given = (kwargs or {}).get(env_id)
        try:
            env: Any = (
                make_text_env(env_id, kwargs=given)
                if find_env(env_id).kind == "text"
                else make_env(env_id, kwargs=given)
            )
        except Exception as exc:
            raise ConfigError(f"preload: cannot create '{env_id}': {exc}") from exc
        with contextlib.suppress(Exception):
            env.close()
