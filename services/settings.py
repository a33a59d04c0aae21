"""What every settings model is built from: the strict base model, and the field type that names
another service of the run, with the walkers that find those names in a validated model.

Apart from services/config.py so that the registry (whose specs are generic over a settings
model) and the start order (which follows the names) can use them without importing the config
loader, which imports both.
"""

from __future__ import annotations

import typing
from collections.abc import Iterator, Mapping
from typing import Annotated, Any, ClassVar

from pydantic import BaseModel, ConfigDict

__all__ = ["Loc", "ServiceRef", "StrictModel", "address_refs", "service_refs"]

Loc = tuple[str | int, ...]


class StrictModel(BaseModel):
    """Base of every config model: unknown keys are errors (typos must not be ignored) and
    values are immutable once validated (a running service cannot drift from its config)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # Names users bring from other tools (TRL's ``beta``, SB3's ``n_envs``) -> either the knob
    # this model calls it (``"num_envs"``) or a one-line explanation; an unknown-key error for
    # this model shows it instead of a spelling suggestion.
    aliases: ClassVar[Mapping[str, str]] = {}


class _ServiceRefMarker:
    """Metadata marking a settings field as a reference to another service instance."""

    def __repr__(self) -> str:
        return "ServiceRef"


_SERVICE_REF = _ServiceRefMarker()
ServiceRef = Annotated[str, _SERVICE_REF]
"""A settings field holding a service instance name (``env-a``) or a ``host:port``.

Names are checked against the run's services at load time; the service turns them into
addresses at runtime with ``ServiceContext.resolve``."""


def service_refs(value: Any, loc: Loc) -> Iterator[tuple[Loc, str]]:
    """Every ServiceRef value inside a validated settings model, with its location."""
    if not isinstance(value, BaseModel):
        return
    for name, info in type(value).model_fields.items():
        item = getattr(value, name)
        # The marker of `ServiceRef` is the field's own, that of `list[ServiceRef]` or of
        # `ServiceRef | None` one of the annotation's arguments'.
        inner = any(
            _SERVICE_REF in getattr(arg, "__metadata__", ())
            for arg in typing.get_args(info.annotation)
        )
        if (_SERVICE_REF in info.metadata or inner) and isinstance(item, str):
            yield (*loc, name), item
        elif isinstance(item, list | tuple) and inner:
            yield from (((*loc, name, i), v) for i, v in enumerate(item) if isinstance(v, str))
        elif isinstance(item, BaseModel):
            yield from service_refs(item, (*loc, name))


def address_refs(value: Any, loc: Loc) -> Iterator[tuple[Loc, str]]:
    """Service names a settings model uses inside strings (``{address:env-0}`` placeholders of
    the ``process`` kind), from its optional ``address_refs()``: each must be a service of the
    run that serves gRPC (has an address)."""
    refs = getattr(value, "address_refs", None)
    if callable(refs):
        yield from (((*loc, *sub), name) for sub, name in refs())
