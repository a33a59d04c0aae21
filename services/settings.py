"""What every settings model is built from: the strict base model, and the field type that names
another service of the run, with the walkers that find those names in a validated model.

Apart from services/config.py so that the registry (whose specs are generic over a settings
model) and the start order (which follows the names) can use them without importing the config
loader, which imports both.
"""

from __future__ import annotations

import ipaddress
import re
import typing
from collections.abc import Iterator, Mapping
from typing import Annotated, Any, ClassVar

from pydantic import AfterValidator, BaseModel, ConfigDict

__all__ = [
    "Loc",
    "ServiceRef",
    "StrictModel",
    "address_problem",
    "address_refs",
    "host_problem",
    "service_refs",
]

Loc = tuple[str | int, ...]


class StrictModel(BaseModel):
    """Base of every config model: unknown keys are errors (typos must not be ignored),
    values are immutable once validated (a running service cannot drift from its config), and
    a float setting is finite (``1e400`` reads as inf, which passes ``gt=0`` and poisons
    training; no setting means "unbounded" by inf: those use None)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    # Names users bring from other tools (TRL's ``beta``, SB3's ``n_envs``) -> either the knob
    # this model calls it (``"num_envs"``) or a one-line explanation; an unknown-key error for
    # this model shows it instead of a spelling suggestion.
    aliases: ClassVar[Mapping[str, str]] = {}


class _ServiceRefMarker:
    """Metadata marking a settings field as a reference to another service instance."""

    def __repr__(self) -> str:
        return "ServiceRef"


# One DNS label as host names use them (letters, digits, inner hyphens; underscores too, which
# container DNS names and rlfleet's instance names have), at most 63 characters.
_LABEL = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?")
_MAX_HOST_NAME = 253  # characters of a whole DNS name


def host_problem(host: str, *, wildcard: bool = False) -> str | None:
    """Why ``host`` is neither an IP address nor a DNS host name, or None. ``wildcard`` allows
    a leading ``*.`` label (a certificate's host names)."""
    if not host:
        return "empty host name"
    try:
        ipaddress.ip_address(host)
        return None
    except ValueError:
        pass
    if re.fullmatch(r"[0-9.]+", host):  # no name is all digits: a mistyped IPv4 address
        return f"'{host}' is not an IPv4 address (four numbers 0-255)"
    if len(host) > _MAX_HOST_NAME:
        return f"host name of {len(host)} characters, over {_MAX_HOST_NAME}"
    labels = host.split(".")
    if wildcard and labels[0] == "*" and len(labels) > 1:
        labels = labels[1:]
    bad = next((label for label in labels if not _LABEL.fullmatch(label)), None)
    if bad is not None:
        what = "an empty label" if not bad else f"label {bad!r}"
        return (
            f"'{host}' is not a valid host name ({what}: labels are 1-63 letters, digits, "
            "'-' or '_', not starting or ending with '-')"
        )
    return None


def address_problem(address: str) -> str | None:
    """Why ``address`` is not ``host:port`` (``[v6 address]:port``) with a port 1-65535 and a
    valid host, or None."""
    if address.startswith("["):
        host, sep, port = address[1:].partition("]:")
        if not sep:
            return f"'{address}' is not [IPv6 address]:port"
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            return f"'{host}' in '{address}' is not an IPv6 address"
    else:
        host, _, port = address.rpartition(":")
        if ":" in host:
            return f"'{address}': an IPv6 address goes in brackets ([::1]:50051)"
        problem = host_problem(host)
        if problem is not None:
            return f"{problem} in address '{address}'"
    if not re.fullmatch(r"[0-9]{1,5}", port) or not 1 <= int(port) <= 65535:
        return f"port '{port}' of '{address}' is not a number in 1-65535"
    return None


def _check_ref(value: str | None) -> str | None:
    """A ServiceRef with a ':' is an address and must be a possible one (names are checked
    against the run's services at load)."""
    if value is not None and ":" in value:
        problem = address_problem(value)
        if problem is not None:
            raise ValueError(problem)
    return value


_SERVICE_REF = _ServiceRefMarker()
ServiceRef = Annotated[str, _SERVICE_REF, AfterValidator(_check_ref)]
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
