"""Typed name -> function registries for the algorithm layer, and the ``rlfleet.algos`` plugins.

One registry per family, each generic over the family's ``Protocol`` (``learner.algos.protocols``):

=====================  ==================  =========================================================
registry               protocol            read by
=====================  ==================  =========================================================
``GAME_ADVANTAGES``    GameAdvantageFn     the game learner, via ``GamePreset.advantage`` (``gae``)
``GROUP_ADVANTAGES``   GroupAdvantageFn    the LM learner, via ``Preset.advantage`` (``grpo``, ...)
``POLICY_LOSSES``      PolicyLossFn        both learners, via ``GamePreset``/``Preset.policy_loss``
``AGGREGATIONS``       AggregationFn       ``aggregate(loss, mask, mode)``, ``Preset.aggregation``
``KL_ESTIMATORS``      KLEstimatorFn       ``kl_penalty(..., estimator=)``, ``Preset.kl_estimator``
``SCHEDULES``          ScheduleFn          ``Preset.chord_mu`` (``Preset.chord_schedule``)
``GAME_PRESETS``       (GamePreset)        ``LearnerSettings.algo``
``PRESETS``            (Preset)            ``LMLearnerSettings.preset``
=====================  ==================  =========================================================

A function registered in a typed registry is checked against its protocol at once
(``check_signature``), so one of the wrong family fails where it is registered; a preset naming a
function of another family fails when the preset is validated, with a message naming the field
and the family the name belongs to. Registering a name twice is an error; looking up an unknown
name lists the known ones, with a did-you-mean.

Built-in functions register themselves when their modules (``BUILTIN_MODULES``, which import
torch) are imported; the presets (``learner.algos.presets``, data) when ``learner.algos`` is.
Third-party packages extend the registries through the ``rlfleet.algos`` entry-point group: each
entry point's value is a module that registers its functions on import, e.g. in the plugin's
``pyproject.toml``::

    [project.entry-points."rlfleet.algos"]
    my_losses = "my_package.losses"      # module body: @POLICY_LOSSES.register("my_loss") ...

Both load once, lazily, on the first lookup in any registry: the built-ins, then the plugins.
"""

from __future__ import annotations

import difflib
import functools
import importlib
import inspect
import threading
from collections.abc import Callable, Iterator
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any, Generic, TypeVar, cast

from learner.algos.protocols import (
    AggregationFn,
    GameAdvantageFn,
    GroupAdvantageFn,
    KLEstimatorFn,
    PolicyLossFn,
    ScheduleFn,
)

if TYPE_CHECKING:
    from learner.algos.presets import GamePreset, Preset

ENTRY_POINT_GROUP = "rlfleet.algos"
# The modules whose import registers the built-in functions (loaded by load_plugins).
BUILTIN_MODULES = (
    "learner.algos.advantages",
    "learner.algos.aggregation",
    "learner.algos.kl",
    "learner.algos.losses",
    "learner.algos.schedules",
)

T = TypeVar("T")
F = TypeVar("F")

_P = inspect.Parameter
_POSITIONAL = (_P.POSITIONAL_ONLY, _P.POSITIONAL_OR_KEYWORD)
_VARIADIC = (_P.VAR_POSITIONAL, _P.VAR_KEYWORD)


class DuplicateNameError(ValueError):
    """A name was registered twice in one registry."""


class UnknownNameError(LookupError):
    """A lookup asked for a name that no built-in or plugin registered."""

    def __str__(self) -> str:  # LookupError would repr() the message; keep it readable
        return str(self.args[0]) if self.args else ""


class WrongFamilyError(UnknownNameError):
    """A lookup asked one family for a name registered in another (``gae`` as a group
    advantage): unknown in this registry, and the message says where the name lives."""


class SignatureError(TypeError):
    """A function registered in a typed registry does not match the family's protocol."""


class PluginLoadError(ImportError):
    """An ``rlfleet.algos`` entry point failed to import."""


def _did_you_mean(name: str, candidates: list[str]) -> str:
    close = difflib.get_close_matches(name, candidates, n=3, cutoff=0.6)
    return f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""


def _a(kind: str) -> str:
    return f"an {kind}" if kind[0] in "aeiouAEIOU" or kind.startswith("LM") else f"a {kind}"


def _protocol_params(protocol: type) -> list[inspect.Parameter]:
    return list(inspect.signature(protocol.__call__).parameters.values())[1:]  # without self


def protocol_signature(protocol: type) -> str:
    """The protocol's call without annotations: ``(logp, old_logp, adv, mask=None, **hp)``."""
    parts, star = [], False
    for p in _protocol_params(protocol):
        if p.kind is _P.KEYWORD_ONLY and not star:
            parts.append("*")
            star = True
        prefix = "**" if p.kind is _P.VAR_KEYWORD else "*" if p.kind is _P.VAR_POSITIONAL else ""
        default = "" if p.default is _P.empty else f"={p.default!r}"
        parts.append(f"{prefix}{p.name}{default}")
    return f"({', '.join(parts)})"


def check_signature(fn: object, protocol: type, what: str) -> None:
    """Raise ``SignatureError`` unless ``fn`` can be called as ``protocol.__call__`` is.

    The protocol's positional parameters must come first in ``fn``, in order and with the same
    names (callers pass them by position or by name); its keyword-only ones must be accepted by
    name; a protocol parameter with a default needs a default in ``fn`` (callers may leave it
    out); any other parameter of ``fn`` is a hyperparameter and needs a default.
    """
    try:
        have = list(inspect.signature(fn).parameters.values())  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise SignatureError(f"{what} must be a function, got {fn!r}") from None
    want = _protocol_params(protocol)
    var_pos = any(p.kind is _P.VAR_POSITIONAL for p in have)
    var_kw = any(p.kind is _P.VAR_KEYWORD for p in have)
    by_name = {p.name: p for p in have}
    problems: list[str] = []

    def needs_default(w: inspect.Parameter, h: inspect.Parameter) -> None:
        if w.default is not _P.empty and h.default is _P.empty:
            problems.append(f"{h.name!r} needs a default, callers may leave it out")

    want_pos = [p for p in want if p.kind in _POSITIONAL]
    have_pos = [p for p in have if p.kind in _POSITIONAL]
    for i, w in enumerate(want_pos):
        if i >= len(have_pos):
            if not var_pos:
                problems.append(f"no parameter {w.name!r} at position {i + 1}")
            continue
        h = have_pos[i]
        if w.kind is _P.POSITIONAL_OR_KEYWORD and h.name != w.name:
            problems.append(f"parameter {i + 1} is {h.name!r}, expected {w.name!r}")
        elif w.kind is _P.POSITIONAL_OR_KEYWORD and h.kind is _P.POSITIONAL_ONLY:
            problems.append(f"{h.name!r} is positional-only, callers may pass it by name")
        else:
            needs_default(w, h)
    for w in want:
        if w.kind is not _P.KEYWORD_ONLY:
            continue
        h_kw = by_name.get(w.name)
        if h_kw is None or h_kw.kind is _P.POSITIONAL_ONLY or h_kw.kind in _VARIADIC:
            if not var_kw:
                problems.append(f"does not take the keyword {w.name!r}")
        else:
            needs_default(w, h_kw)
    matched = {p.name for p in have_pos[: len(want_pos)]} | {p.name for p in want}
    for h in have:
        if h.name not in matched and h.kind not in _VARIADIC and h.default is _P.empty:
            problems.append(f"hyperparameter {h.name!r} needs a default")
    if problems:
        raise SignatureError(
            f"{what} does not match {protocol.__name__}{protocol_signature(protocol)}: "
            + "; ".join(problems)
        )


class Registry(Generic[T]):
    """A named collection of objects of one kind; with a ``protocol``, a typed family of
    functions, each checked against ``protocol`` when it is added."""

    def __init__(self, kind: str, protocol: type | None = None) -> None:
        self.kind = kind  # used in error messages, e.g. "policy loss"
        self.protocol = protocol
        self._items: dict[str, T] = {}

    def register(self, name: str) -> Callable[[F], F]:
        """Decorator: ``@REGISTRY.register("name")`` adds the decorated function under ``name``
        (and returns it unchanged, with its own signature)."""

        def decorator(obj: F) -> F:
            self.add(name, cast(T, obj))
            return obj

        return decorator

    def add(self, name: str, obj: T) -> None:
        if not name or not isinstance(name, str):
            raise ValueError(f"{self.kind} name must be a non-empty string, got {name!r}")
        if name in self._items:
            raise DuplicateNameError(
                f"{self.kind} {name!r} is already registered (by {_origin(self._items[name])})"
            )
        if self.protocol is not None:
            check_signature(obj, self.protocol, f"{self.kind} {name!r} ({_origin(obj)})")
        self._items[name] = obj

    def get(self, name: str, *, field: str | None = None) -> T:
        """The object registered as ``name``; ``field`` (e.g. ``"advantage"``) prefixes the
        error, which lists the known names, a close match, and another family holding ``name``."""
        load_plugins()
        try:
            return self._items[name]
        except KeyError:
            raise self._unknown(name, field) from None

    def registered(self, name: str) -> T | None:
        """``name``'s object if it is registered already, else None; unlike ``get`` this loads
        nothing (neither the built-in functions nor the plugins)."""
        return self._items.get(name)

    def _unknown(self, name: str, field: str | None) -> UnknownNameError:
        prefix = f"{field}: " if field else ""
        known = ", ".join(sorted(self._items)) or "none"
        if self in FAMILIES:
            owners = [r.kind for r in FAMILIES if r is not self and name in r._items]
            if owners:
                return WrongFamilyError(
                    f"{prefix}{name!r} is {' and '.join(map(_a, owners))}, not {_a(self.kind)}; "
                    f"known {self.kind} names: {known}"
                )
        hint = _did_you_mean(str(name), sorted(self._items))
        return UnknownNameError(f"{prefix}unknown {self.kind} {name!r}; known: {known}{hint}")

    def hyperparameters(self, name: str) -> list[str] | None:
        """Keyword parameters of ``name`` beyond its protocol's (what a preset's ``*_kwargs``
        may set), in order; None when it takes ``**kwargs`` (anything goes)."""
        params = list(inspect.signature(self.get(name)).parameters.values())  # type: ignore[arg-type]
        if any(p.kind is _P.VAR_KEYWORD for p in params):
            return None
        fixed = {p.name for p in _protocol_params(self.protocol)} if self.protocol else set()
        keyword = (_P.KEYWORD_ONLY, _P.POSITIONAL_OR_KEYWORD)
        return [p.name for p in params if p.kind in keyword and p.name not in fixed]

    def check_kwargs(self, name: str, kwargs: dict[str, Any], *, field: str) -> None:
        """Raise ``ValueError`` naming ``field`` unless ``name`` takes every key of ``kwargs``."""
        valid = self.hyperparameters(name)
        if valid is None:
            return
        for key in kwargs:
            if key not in valid:
                raise ValueError(
                    f"{field}: {self.kind} {name!r} has no hyperparameter {key!r}; "
                    f"valid: {', '.join(valid) or 'none'}{_did_you_mean(key, valid)}"
                )

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
        protocol = f", {self.protocol.__name__}" if self.protocol else ""
        return f"Registry({self.kind!r}{protocol}, {sorted(self._items)})"


def _origin(obj: object) -> str:
    module = getattr(obj, "__module__", None)
    qualname = getattr(obj, "__qualname__", None)
    return f"{module}.{qualname}" if module and qualname else repr(obj)


GAME_ADVANTAGES: Registry[GameAdvantageFn] = Registry("game advantage estimator", GameAdvantageFn)
GROUP_ADVANTAGES: Registry[GroupAdvantageFn] = Registry(
    "group advantage estimator", GroupAdvantageFn
)
POLICY_LOSSES: Registry[PolicyLossFn] = Registry("policy loss", PolicyLossFn)
AGGREGATIONS: Registry[AggregationFn] = Registry("loss aggregation mode", AggregationFn)
KL_ESTIMATORS: Registry[KLEstimatorFn] = Registry("KL estimator", KLEstimatorFn)
SCHEDULES: Registry[ScheduleFn] = Registry("schedule", ScheduleFn)
GAME_PRESETS: Registry[GamePreset] = Registry("game algorithm preset")  # LearnerSettings.algo
PRESETS: Registry[Preset] = Registry("LM algorithm preset")  # LM presets: LMLearnerSettings.preset

# The typed families, for "'gae' is a game advantage estimator, not a ..." in lookup errors.
FAMILIES: tuple[Registry[Any], ...] = (
    GAME_ADVANTAGES,
    GROUP_ADVANTAGES,
    POLICY_LOSSES,
    AGGREGATIONS,
    KL_ESTIMATORS,
    SCHEDULES,
    GAME_PRESETS,
    PRESETS,
)

_plugins_loaded = False
_plugins_lock = threading.RLock()


@functools.cache  # a scan of every installed distribution's metadata: once per process
def plugins_installed() -> bool:
    """Whether any package declares an ``rlfleet.algos`` entry point (nothing is imported);
    asked once per process, as the plugins are loaded once."""
    return bool(entry_points(group=ENTRY_POINT_GROUP))


def load_plugins() -> None:
    """Import the built-in functions' modules, then every ``rlfleet.algos`` entry point, once
    (idempotent, thread-safe).

    The flag is set before importing, so a module that looks names up while it imports does not
    recurse. A plugin that fails to import raises ``PluginLoadError`` (a clash with a registered
    name raises ``DuplicateNameError``, a function that does not match its family's protocol
    ``SignatureError``) naming the entry point; loading is not retried later, so a broken plugin
    fails the first lookup and the run should stop there.
    """
    global _plugins_loaded
    if _plugins_loaded:
        return
    with _plugins_lock:
        if _plugins_loaded:
            return
        _plugins_loaded = True
        for module in BUILTIN_MODULES:
            importlib.import_module(module)
        for ep in entry_points(group=ENTRY_POINT_GROUP):
            try:
                ep.load()
            except (DuplicateNameError, SignatureError) as exc:
                raise type(exc)(
                    f"{ENTRY_POINT_GROUP} plugin {ep.name!r} ({ep.value}): {exc}"
                ) from exc
            except Exception as exc:
                raise PluginLoadError(
                    f"{ENTRY_POINT_GROUP} plugin {ep.name!r} ({ep.value}) failed to import: {exc}"
                ) from exc
