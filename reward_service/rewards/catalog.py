"""The built-in rewards' registry records, and the registry a reward service starts with:
built-ins, installed plugins, reward models and the run file's references."""

from __future__ import annotations

from collections.abc import Iterable
from importlib import metadata

from reward_service.rewards.accuracy import accuracy
from reward_service.rewards.format import check_format_kwargs, format_reward
from reward_service.rewards.length import (
    check_cosine_kwargs,
    check_overlong_kwargs,
    cosine,
    soft_overlong,
)
from reward_service.rewards.registry import (
    Kind,
    RewardFunction,
    RewardRegistry,
    from_callable,
    load_plugin,
    load_reference,
    plugin_entry_points,
)
from reward_service.rewards.repetition import check_repetition_kwargs, repetition

__all__ = ["BUILTINS", "load_registry", "registered_names", "reward_catalog"]


def _rule(name, fn, *, extra_keys=(), kwargs=(), check=None, timeout_s=10.0) -> RewardFunction:
    # Built-ins take **kwargs (so they also work inside TRL unchanged) but read only the keywords
    # listed here; a request setting any other is INVALID_ARGUMENT.
    return from_callable(
        name,
        fn,
        kind=Kind.RULE,
        source=f"built-in {fn.__module__}:{fn.__name__}",
        extra_keys=extra_keys,
        kwargs=kwargs,
        check_kwargs=check,
        default_timeout_s=timeout_s,
    )


BUILTINS: tuple[RewardFunction, ...] = (
    _rule("accuracy", accuracy, extra_keys=("answer",)),
    _rule("format", format_reward, kwargs=("tags", "pattern"), check=check_format_kwargs),
    _rule(
        "soft_overlong",
        soft_overlong,
        kwargs=("max_completion_len", "cache_len"),
        check=check_overlong_kwargs,
    ),
    _rule(
        "repetition",
        repetition,
        kwargs=("ngram_size", "max_penalty"),
        check=check_repetition_kwargs,
    ),
    _rule(
        "cosine",
        cosine,
        extra_keys=("answer",),
        kwargs=(
            "max_len",
            "min_value_wrong",
            "max_value_wrong",
            "min_value_correct",
            "max_value_correct",
        ),
        check=check_cosine_kwargs,
    ),
)


def registered_names() -> list[str]:
    """Names a reward service registers without configuration: the built-ins and the installed
    plugins' entry-point names (their code is not imported)."""
    return [r.name for r in BUILTINS] + [ep.name for ep in plugin_entry_points()]


def reward_catalog() -> list[dict[str, str]]:
    """The installed rewards (built-ins and plugins) as rows (the ``rewards`` catalog of forms):
    name, kind, description."""
    registry = load_registry()
    return [
        {"name": name, "kind": str(registry[name].kind), "description": registry[name].description}
        for name in registry
    ]


def load_registry(
    *,
    builtins: Iterable[RewardFunction] | None = None,
    entry_points: Iterable[metadata.EntryPoint] | None = None,
    extra_entry_points: Iterable[metadata.EntryPoint] = (),
    models: Iterable[RewardFunction] = (),
    references: Iterable[str] = (),
) -> RewardRegistry:
    """Built-ins, then plugins (installed ones unless ``entry_points`` is given, plus
    ``extra_entry_points``), then reward models, then the run file's ``references``, all loaded
    now so a broken plugin fails the service's start rather than a request."""
    if builtins is None:
        builtins = BUILTINS
    registry = RewardRegistry()
    for reward in builtins:
        registry.add(reward)
    installed = plugin_entry_points() if entry_points is None else list(entry_points)
    for ep in [*installed, *extra_entry_points]:
        registry.add(load_plugin(ep))
    for model in models:
        registry.add(model)
    for ref in references:
        registry.add(load_reference(ref))
    return registry
