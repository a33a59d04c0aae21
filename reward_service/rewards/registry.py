"""Reward functions by name: the built-ins, entry-point plugins and reward models.

Every reward has the signature TRL and ms-swift users already write,
``f(completions: list[str], **kwargs) -> list[float | None]`` (None = abstain), and is described
by a `RewardFunction` record: what ListRewards reports and what the servicer needs to call it
(which hyperparameter keywords it takes, its default time budget).

Plugins come from the ``rlfleet.rewards`` entry-point group. An entry point's value is either a
plain callable (its description is its docstring; the keywords it takes come from its signature,
and every item's extra key, a dataset column, reaches a parameter of its name, as TRL passes
columns; the optional attributes ``extra_keys`` and ``default_timeout_s`` say the rest) or a ready
`RewardFunction`. A name registered twice, by anyone, is an error naming both sources: picking
one silently would depend on install order.

A run file may also name a function directly, by reference: ``module:function`` (an importable
module) or ``path/to/file.py:function`` (a file, relative to the current directory, imported
under a module name of its own). The reference itself is the reward's name, in requests and
metrics alike; `check_reference` imports and checks one when the config is validated and
`load_reference` makes its record when the service starts (beside the entry points: the same
name twice is an error there too).
"""

from __future__ import annotations

import difflib
import enum
import inspect
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from importlib import metadata
from typing import Any

from clients.reward import BATCH_KEYS
from services.errors import ConfigError
from services.references import import_reference_module, is_reference, split_reference

__all__ = [
    "BATCH_KEYS",
    "REWARDS_GROUP",
    "Kind",
    "RewardFunction",
    "RewardRegistry",
    "check_reference",
    "from_callable",
    "is_reference",
    "load_plugin",
    "load_reference",
    "plugin_entry_points",
]

REWARDS_GROUP = "rlfleet.rewards"
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


# --- references from the run file --------------------------------------------------------------

REFERENCE_FORMS = "'module:function' or 'path/to/file.py:function'"
# Keywords the service passes by name to a function that names them (see runner.py): the batch
# columns besides the completions, which go first and positionally.
_PASSED = frozenset(BATCH_KEYS) - {"completions"}


def _resolve(ref: str) -> tuple[Any, str]:
    """The object a reference names and where it was found; ValueError saying what is wrong."""
    where, attr = split_reference(ref, REFERENCE_FORMS)
    if not attr.isidentifier():
        raise ValueError(f"expected {REFERENCE_FORMS}")
    module, label, origin = import_reference_module(where)
    if not hasattr(module, attr):
        names = [n for n in vars(module) if not n.startswith("_")]
        close = difflib.get_close_matches(attr, names, n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        raise ValueError(f"module {label} has no attribute '{attr}'{hint}")
    return getattr(module, attr), origin


def _check_signature(
    fn: Callable[..., Any], kwargs: Iterable[str] | None, columns: Iterable[str] | None = None
) -> None:
    """ValueError unless the service can call ``fn(completions, **passed)``: a first positional
    parameter ``completions`` and, when ``kwargs`` (the hyperparameters a run sets) is known,
    no other required parameter it cannot fill. Every column of the items (``ScoreItem.extra``:
    the dataset's columns, as TRL passes them) is passed to a parameter of its name, so with
    ``columns`` unknown (None) any other required parameter may be one; with them known it must
    be one of them."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # a builtin or C callable: nothing to check
    params = list(sig.parameters.values())
    call = "the service calls f(completions, **kwargs)"
    if not params:
        raise ValueError(f"takes no arguments; {call}")
    first = params[0]
    if first.kind in (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.VAR_KEYWORD):
        raise ValueError(f"has no positional first parameter for the completions; {call}")
    if first.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD and first.name != "completions":
        raise ValueError(f"first parameter is '{first.name}', not 'completions'; {call}")
    if kwargs is None:
        return
    fillable = _PASSED | set(getattr(fn, "extra_keys", ())) | set(kwargs) | set(columns or ())
    listed = ", ".join(sorted(columns or ())) or "none"
    for p in params[1:]:
        required = p.default is inspect.Parameter.empty
        if p.kind is inspect.Parameter.POSITIONAL_ONLY and required:
            raise ValueError(f"parameter '{p.name}' is positional-only with no default; {call}")
        named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        if p.kind in named and required and columns is not None and p.name not in fillable:
            raise ValueError(
                f"parameter '{p.name}' has no default and nothing passes it: set it in kwargs, "
                f"or give the dataset a '{p.name}' column (its columns: {listed})"
            )


def _reference_record(ref: str, obj: Any, origin: str) -> RewardFunction:
    source = f"run-file reference '{ref}' ({origin})"
    if isinstance(obj, RewardFunction):
        return replace(obj, name=ref, kind=Kind.PLUGIN, source=source)
    if not callable(obj):
        raise ValueError(f"is a {type(obj).__name__}, not a function")
    return from_callable(ref, obj, kind=Kind.PLUGIN, source=source)


def check_reference(
    ref: str, kwargs: Mapping[str, Any] | None = None, columns: Iterable[str] | None = None
) -> RewardFunction:
    """Import and check a reference at config-load time; ValueError ``'<ref>' — <reason>``.

    ``kwargs``: the hyperparameters the run passes it (checked against its signature), or None
    where they are not known yet (they come with each request). ``columns``: the dataset's
    columns, where known (a job's), which its other required parameters must be."""
    try:
        record = _reference_record(ref, *_resolve(ref))
        _check_signature(record.fn, None if kwargs is None else list(kwargs), columns)
        for key in kwargs or ():
            if key in BATCH_KEYS or (record.kwargs is not None and key not in record.kwargs):
                takes = ", ".join(sorted(record.kwargs or ())) or "none"
                raise ValueError(f"takes no keyword '{key}' (takes: {takes})")
    except (ValueError, ConfigError) as exc:
        raise ValueError(f"'{ref}' — {exc}") from None
    return record


def load_reference(ref: str) -> RewardFunction:
    """The PLUGIN record of a reference, for the service's start; ConfigError naming it."""
    try:
        return check_reference(ref)
    except ValueError as exc:
        raise ConfigError(f"reward {exc}") from None
