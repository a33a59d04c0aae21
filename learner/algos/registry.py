"""Name -> function registries for the algorithm layer, and the ``rlfleet.algos`` plugin loader.

Built-in algorithms register themselves when ``learner.algos`` is imported. Third-party packages
extend the registries through the ``rlfleet.algos`` entry-point group: each entry point's value is a
module that registers its functions on import, e.g. in the plugin's ``pyproject.toml``::

    [project.entry-points."rlfleet.algos"]
    my_losses = "my_package.losses"      # module body: @POLICY_LOSSES.register("my_loss") ...

Plugins load once, lazily, on the first lookup in any registry. Registering a name twice is an
error, and so is looking up a name nobody registered (the message lists the known names).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from importlib.metadata import entry_points
from typing import Any, Generic, TypeVar

ENTRY_POINT_GROUP = "rlfleet.algos"

T = TypeVar("T")


class DuplicateNameError(ValueError):
    """A name was registered twice in one registry."""


class UnknownNameError(LookupError):
    """A lookup asked for a name that no built-in or plugin registered."""

    def __str__(self) -> str:  # LookupError would repr() the message; keep it readable
        return str(self.args[0]) if self.args else ""


class PluginLoadError(ImportError):
    """An ``rlfleet.algos`` entry point failed to import."""


class Registry(Generic[T]):
    """A named collection of objects (loss functions, estimators, ...) of one kind."""

    def __init__(self, kind: str) -> None:
        self.kind = kind  # used in error messages, e.g. "policy loss"
        self._items: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator: ``@REGISTRY.register("name")`` adds the decorated object under ``name``."""

        def decorator(obj: T) -> T:
            self.add(name, obj)
            return obj

        return decorator

    def add(self, name: str, obj: T) -> None:
        if not name or not isinstance(name, str):
            raise ValueError(f"{self.kind} name must be a non-empty string, got {name!r}")
        if name in self._items:
            raise DuplicateNameError(
                f"{self.kind} {name!r} is already registered (by {_origin(self._items[name])})"
            )
        self._items[name] = obj

    def get(self, name: str) -> T:
        load_plugins()
        try:
            return self._items[name]
        except KeyError:
            known = ", ".join(sorted(self._items)) or "none"
            raise UnknownNameError(f"unknown {self.kind} {name!r}; known: {known}") from None

    def names(self) -> list[str]:
        load_plugins()
        return sorted(self._items)

    def __contains__(self, name: object) -> bool:
        load_plugins()
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self.names())

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {sorted(self._items)})"


def _origin(obj: object) -> str:
    module = getattr(obj, "__module__", None)
    qualname = getattr(obj, "__qualname__", None)
    return f"{module}.{qualname}" if module and qualname else repr(obj)


# Signatures are keyword-based and differ per family (see each module); the registries hold them.
ADVANTAGES: Registry[Callable[..., Any]] = Registry("advantage estimator")
POLICY_LOSSES: Registry[Callable[..., Any]] = Registry("policy loss")
VALUE_LOSSES: Registry[Callable[..., Any]] = Registry("value loss")
AGGREGATIONS: Registry[Callable[..., Any]] = Registry("loss aggregation mode")
SCHEDULES: Registry[Callable[..., float]] = Registry("schedule")
KL_ESTIMATORS: Registry[Callable[..., Any]] = Registry("KL estimator")
SFT_LOSSES: Registry[Callable[..., Any]] = Registry("SFT loss")
PREFERENCE_LOSSES: Registry[Callable[..., Any]] = Registry("preference loss")
PRESETS: Registry[Any] = Registry("algorithm preset")  # learner.algos.presets.Preset objects

_plugins_loaded = False
_plugins_lock = threading.RLock()


def load_plugins() -> None:
    """Import every ``rlfleet.algos`` entry point once (idempotent, thread-safe).

    The flag is set before importing, so a plugin that looks names up while it imports does not
    recurse. A plugin that fails to import raises ``PluginLoadError`` (a clash with a registered
    name raises ``DuplicateNameError``) naming the entry point; loading is not retried later, so a
    broken plugin fails the first lookup and the run should stop there.
    """
    global _plugins_loaded
    if _plugins_loaded:
        return
    with _plugins_lock:
        if _plugins_loaded:
            return
        _plugins_loaded = True
        for ep in entry_points(group=ENTRY_POINT_GROUP):
            try:
                ep.load()
            except DuplicateNameError as exc:
                raise DuplicateNameError(
                    f"{ENTRY_POINT_GROUP} plugin {ep.name!r} ({ep.value}): {exc}"
                ) from exc
            except Exception as exc:
                raise PluginLoadError(
                    f"{ENTRY_POINT_GROUP} plugin {ep.name!r} ({ep.value}) failed to import: {exc}"
                ) from exc
