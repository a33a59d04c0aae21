"""Reward functions by name: the built-ins, entry-point plugins and reward models.

Every reward has the signature TRL and ms-swift users already write,
``f(completions: list[str], **kwargs) -> list[float | None]`` (None = abstain), and is described
by a `RewardFunction` record: what ListRewards reports and what the servicer needs to call it
(which hyperparameter keywords it takes, its default time budget).

Plugins come from the ``rlfleet.rewards`` entry-point group. An entry point's value is either a
plain callable (its description is its docstring; the keywords it takes come from its signature;
the optional attributes ``extra_keys`` and ``default_timeout_s`` say the rest) or a ready
`RewardFunction`. A name registered twice, by anyone, is an error naming both sources: picking
one silently would depend on install order.
"""

from __future__ import annotations

import enum
import inspect
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from importlib import metadata
from typing import Any

from services.errors import ConfigError

__all__ = [
    "BATCH_KEYS",
    "REWARDS_GROUP",
    "Kind",
    "RewardFunction",
    "RewardRegistry",
    "from_callable",
    "load_registry",
]

REWARDS_GROUP = "rlfleet.rewards"
# What every call receives, one entry per item; ScoreItem.extra may not use these names.
BATCH_KEYS = ("prompts", "completions", "prompt_ids", "completion_ids")
DEFAULT_TIMEOUT_S = 30.0


class Kind(enum.StrEnum):
    """Where a reward comes from (RewardKind in the proto)."""

    RULE = "rule"
    PLUGIN = "plugin"
    MODEL = "model"


@dataclass(frozen=True)
class RewardFunction:
    """One named reward and everything needed to list and call it."""

    name: str
    fn: Callable[..., Any]  # sync or async; f(completions, **kwargs) -> list[float | None]
    kind: Kind
    description: str
    extra_keys: tuple[str, ...] = ()  # ScoreItem.extra keys it reads
    default_timeout_s: float = DEFAULT_TIMEOUT_S
    # Hyperparameter keywords a request may set (RewardWeight.kwargs); None: any (the function
    # takes **kwargs and we cannot tell which it reads).
    kwargs: frozenset[str] | None = frozenset()
    # Raises ValueError for bad hyperparameters, so a request gets INVALID_ARGUMENT up front
    # rather than an error on every item.
    check_kwargs: Callable[[Mapping[str, Any]], None] | None = None
    source: str = ""  # where it was registered, for the duplicate-name error
    # Parameter names fn can receive; None: it takes **kwargs (everything is passed).
    params: frozenset[str] | None = field(default=None)

    @property
    def ready(self) -> bool:
        """False while a reward model is still loading."""
        return bool(getattr(self.fn, "ready", True))

    def call_kwargs(self, kwargs: Mapping[str, Any]) -> dict[str, Any]:
        """The subset of batch and extra keywords fn can take (all of them for **kwargs)."""
        if self.params is None:
            return dict(kwargs)
        return {k: v for k, v in kwargs.items() if k in self.params}


def _signature_params(fn: Callable[..., Any]) -> frozenset[str] | None:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None  # a builtin or C callable: pass everything and let it complain
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.parameters.values()):
        return None
    return frozenset(
        name
        for name, p in sig.parameters.items()
        if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    )


def _one_paragraph(doc: str | None) -> str:
    """A docstring as one line of text (ListRewards shows it as a paragraph)."""
    return " ".join(inspect.cleandoc(doc or "").split())


def from_callable(
    name: str,
    fn: Callable[..., Any],
    *,
    kind: Kind = Kind.PLUGIN,
    source: str = "",
    description: str | None = None,
    extra_keys: Iterable[str] | None = None,
    default_timeout_s: float | None = None,
    kwargs: Iterable[str] | None = None,
    check_kwargs: Callable[[Mapping[str, Any]], None] | None = None,
) -> RewardFunction:
    """A record for a plain TRL-style callable, inferring what is not given.

    Hyperparameters are the named keyword parameters that are neither batch keys nor extra keys;
    a function taking ``**kwargs`` accepts any.
    """
    if not callable(fn):
        raise ConfigError(f"reward '{name}' ({source}) is not callable: {type(fn).__name__}")
    params = _signature_params(fn)
    extras = tuple(extra_keys if extra_keys is not None else getattr(fn, "extra_keys", ()))
    if kwargs is not None:
        accepted: frozenset[str] | None = frozenset(kwargs)
    elif params is None:
        accepted = None
    else:
        accepted = params - set(BATCH_KEYS) - set(extras)
    timeout = (
        default_timeout_s
        if default_timeout_s
        else getattr(fn, "default_timeout_s", DEFAULT_TIMEOUT_S)
    )
    return RewardFunction(
        name=name,
        fn=fn,
        kind=kind,
        description=description or _one_paragraph(fn.__doc__) or f"reward '{name}'",
        extra_keys=extras,
        default_timeout_s=float(timeout),
        kwargs=accepted,
        check_kwargs=check_kwargs,
        source=source,
        params=params,
    )


class RewardRegistry(Mapping[str, RewardFunction]):
    """Name -> RewardFunction; adding a name twice is a ConfigError naming both sources."""

    def __init__(self) -> None:
        self._rewards: dict[str, RewardFunction] = {}

    def add(self, reward: RewardFunction) -> None:
        previous = self._rewards.get(reward.name)
        if previous is not None:
            raise ConfigError(
                f"reward '{reward.name}' is registered twice: {previous.source} and {reward.source}"
            )
        self._rewards[reward.name] = reward

    def __getitem__(self, name: str) -> RewardFunction:
        return self._rewards[name]

    def __iter__(self):  # sorted: ListRewards and error messages list names in this order
        return iter(sorted(self._rewards))

    def __len__(self) -> int:
        return len(self._rewards)


def _origin(ep: metadata.EntryPoint) -> str:
    dist = getattr(ep, "dist", None)
    where = f" from {dist.name}" if dist is not None else ""
    return f"entry point '{ep.name}' = {ep.value}{where}"


def plugin_entry_points() -> list[metadata.EntryPoint]:
    """Installed entry points of ``rlfleet.rewards``, one per target (a package seen on two
    sys.path entries is listed twice with the same value: not a clash)."""
    seen: dict[tuple[str, str], metadata.EntryPoint] = {}
    for ep in metadata.entry_points(group=REWARDS_GROUP):
        seen.setdefault((ep.name, ep.value), ep)
    return list(seen.values())


def load_plugin(ep: metadata.EntryPoint) -> RewardFunction:
    """Load one entry point into a PLUGIN record; failures name the entry point."""
    source = _origin(ep)
    try:
        obj = ep.load()
    except Exception as exc:
        raise ConfigError(
            f"reward plugin {source} failed to load: {type(exc).__name__}: {exc}"
        ) from exc
    if isinstance(obj, RewardFunction):
        return replace(obj, name=ep.name, kind=Kind.PLUGIN, source=source)
    return from_callable(ep.name, obj, kind=Kind.PLUGIN, source=source)


def load_registry(
    *,
    builtins: Iterable[RewardFunction] | None = None,
    entry_points: Iterable[metadata.EntryPoint] | None = None,
    extra_entry_points: Iterable[metadata.EntryPoint] = (),
    models: Iterable[RewardFunction] = (),
) -> RewardRegistry:
    """Built-ins, then plugins (installed ones unless ``entry_points`` is given, plus
    ``extra_entry_points``), then reward models, all loaded now so a broken plugin fails the
    service's start rather than a request."""
    if builtins is None:
        from reward_service.rewards import BUILTINS

        builtins = BUILTINS
    registry = RewardRegistry()
    for reward in builtins:
        registry.add(reward)
    installed = plugin_entry_points() if entry_points is None else list(entry_points)
    for ep in [*installed, *extra_entry_points]:
        registry.add(load_plugin(ep))
    for model in models:
        registry.add(model)
    return registry
