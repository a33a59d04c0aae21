"""When `rlfleet up` starts each service of a run, and the order it stops them in.

A service starts as soon as every service it *needs* is up (reports gRPC health SERVING, or has
started, for a kind without gRPC), so services that do not depend on each other start together
instead of one after another: in the LM jobs the vLLM sampler, by far the slowest to start, no
longer waits for the reward service and the learner to be healthy first. What an instance needs,
the first of these that applies:

1. ``after: [names]`` on its entry in the run file (``after: []``: nothing);
2. its kind's ``ServiceSpec.needs(settings)``: the kind knows which peers it cannot start without
   (`named_services`: every service its settings name; `needs_nothing`: it waits for its peers
   itself, retrying until they answer);
3. otherwise every service listed before it: a kind that does not say may rely on anything
   started before it, the order `rlfleet up` always had.

A cycle is a config error. Stopping goes the other way, in waves: a service is stopped once every
service that needs it or names it in its settings (talks to it) has stopped, and the services of
one wave stop together. With nothing declared, both orders are the config order and its reverse.

The functions take any run config with service entries (`RunLike`, `EntryLike`): the config
loader validates a run with `start_problems`, so this module does not import it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from services.registry import get_service
from services.settings import Loc, address_refs, service_refs

__all__ = [
    "EntryLike",
    "Needs",
    "RunLike",
    "in_config_order",
    "named_services",
    "needs_nothing",
    "start_needs",
    "start_problems",
    "stop_waves",
]

Needs = Mapping[str, tuple[str, ...]]


class EntryLike(Protocol):
    """What the order reads of a service entry (services.config.ServiceEntry)."""

    @property
    def name(self) -> str: ...
    @property
    def service(self) -> str: ...
    @property
    def after(self) -> list[str] | None: ...
    @property
    def settings(self) -> Any: ...


class RunLike(Protocol):
    """What the order reads of a run config (services.config.RunConfig): its entries in order."""

    @property
    def services(self) -> Sequence[EntryLike]: ...


def named_services(settings: Any) -> list[str]:
    """Every service instance a validated settings model names (ServiceRef fields and
    ``{address:NAME}`` placeholders; ``host:port`` values are outside the run), in order."""
    refs = [ref for _, ref in (*service_refs(settings, ()), *address_refs(settings, ()))]
    return list(dict.fromkeys(ref for ref in refs if ":" not in ref))


def needs_nothing(settings: Any) -> tuple[str, ...]:
    """For a kind that waits for its peers itself: it may start at once."""
    return ()


def _declared(entry: EntryLike) -> tuple[str, ...] | None:
    if entry.after is not None:
        return tuple(entry.after)
    needs = get_service(entry.service).needs
    return None if needs is None else tuple(dict.fromkeys(needs(entry.settings)))


def in_config_order(config: RunLike) -> bool:
    """True when no service declares what it needs: each waits for all before it, as always."""
    return all(_declared(entry) is None for entry in config.services)


def start_needs(config: RunLike) -> dict[str, tuple[str, ...]]:
    """Each instance's needs, in config order (settings validated, kinds known)."""
    result: dict[str, tuple[str, ...]] = {}
    earlier: list[str] = []
    for entry in config.services:
        declared = _declared(entry)
        result[entry.name] = tuple(earlier) if declared is None else declared
        earlier.append(entry.name)
    return result


def start_problems(config: RunLike) -> list[tuple[Loc, str]]:
    """(location, message) of every ``after`` naming no service (or itself) and of a cycle in
    what services need; [] when every service can start."""
    names = {entry.name for entry in config.services}
    problems: list[tuple[Loc, str]] = []
    for i, entry in enumerate(config.services):
        for j, name in enumerate(entry.after or ()):
            if name == entry.name:
                problems.append((("services", i, "after", j), "a service cannot wait for itself"))
            elif name not in names:
                problems.append((("services", i, "after", j), f"unknown service '{name}'"))
    if problems:
        return problems
    needs = start_needs(config)
    cycle = _cycle(needs)
    if cycle:
        at = next(i for i, e in enumerate(config.services) if e.name == cycle[0])
        path = " -> ".join((*cycle, cycle[0]))
        problems.append(
            (
                ("services", at),
                f"services wait for each other, none could start ({path}; a service without "
                "`after:` or a declaration of its kind waits for every service listed before "
                "it): set `after: [...]` on one of them",
            )
        )
    return problems


def _cycle(needs: Needs) -> list[str]:
    """One cycle of the needs graph (names in order), or []."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(name: str) -> list[str]:
        state[name] = 1
        path.append(name)
        for need in needs.get(name, ()):
            if state.get(need) == 1:
                return path[path.index(need) :]
            if need not in state and (found := visit(need)):
                return found
        state[name] = 2
        path.pop()
        return []

    for name in needs:
        if name not in state and (found := visit(name)):
            return found
    return []


def stop_waves(config: RunLike, needs: Needs) -> list[list[str]]:
    """The services in stop order, grouped in waves that may stop together: a service stops
    after every service that needs it or names it. Names that refer to each other (two
    heartbeats listing each other as peers) fall back to reverse config order."""
    order = [entry.name for entry in config.services]
    users: dict[str, set[str]] = {name: set() for name in order}  # name -> who must stop first
    for entry in config.services:
        for other in (*needs.get(entry.name, ()), *named_services(entry.settings)):
            if other in users and other != entry.name:
                users[other].add(entry.name)
    left = list(reversed(order))
    waves: list[list[str]] = []
    while left:
        wave = [name for name in left if not users[name] & set(left)]
        if not wave:
            wave = left[:1]  # a reference cycle: the latest in the config goes first
        waves.append(wave)
        left = [name for name in left if name not in wave]
    return waves
