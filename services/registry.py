"""Service kinds and the context a service runs in.

A service kind (``env_server``, ``learner``, ...) is found by name through the
``rlfleet.services`` entry-point group, never by file path, so third-party packages can add
kinds and the launcher, ``rlfleet serve`` and container images all find them the same way.
"""

from __future__ import annotations

import asyncio
import difflib
import functools
import json
import os
import socket
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any, Generic, Literal, TypeVar

from services.errors import ConfigError
from services.settings import StrictModel

__all__ = [
    "CATALOGS_GROUP",
    "ENV_CONFIG_DIR",
    "ENV_ENDPOINTS",
    "ENV_LAUNCHER_PID",
    "ENV_METRICS_PORT",
    "ENV_NATS_URL",
    "ENV_REPLICA_NAME",
    "ENV_RUN_CONFIG",
    "ENV_RUN_DIR",
    "ENV_RUN_NAME",
    "SERVICES_GROUP",
    "EntryPointRegistry",
    "JobSpec",
    "ServiceContext",
    "ServiceSpec",
    "SettingsT",
    "entry_point_registry",
    "get_job",
    "get_service",
    "replica_name",
    "service_kinds",
]

SERVICES_GROUP = "rlfleet.services"
JOBS_GROUP = "rlfleet.jobs"
# What a form offers to pick from (env ids, reward names): name -> a function returning rows
# (JSON-ready dicts), so the tooling lists them without importing the packages that own them.
CATALOGS_GROUP = "rlfleet.catalogs"
# The environment a launcher (or a container spec) hands to `rlfleet serve`.
ENV_RUN_NAME = "RLFLEET_RUN_NAME"
ENV_RUN_DIR = "RLFLEET_RUN_DIR"
ENV_RUN_CONFIG = "RLFLEET_RUN_CONFIG"
ENV_NATS_URL = "RLFLEET_NATS_URL"
ENV_ENDPOINTS = "RLFLEET_ENDPOINTS"
ENV_METRICS_PORT = "RLFLEET_METRICS_PORT"
ENV_LAUNCHER_PID = "RLFLEET_LAUNCHER_PID"  # serve stops when this parent is gone
ENV_CONFIG_DIR = "RLFLEET_CONFIG_DIR"  # the run file's folder (relative paths in settings)
ENV_REPLICA_NAME = "RLFLEET_REPLICA_NAME"  # this process among replicas of one instance

# The settings model of one service (or job) kind. Specs and contexts are generic over it, so a
# service entry written ``async def main(ctx: ServiceContext[MySettings])`` gets a typed
# ``ctx.settings`` and ``ServiceSpec(settings=MySettings, main=main)`` checks that the two match.
SettingsT = TypeVar("SettingsT", bound=StrictModel)


@dataclass(frozen=True)
class ServiceSpec(Generic[SettingsT]):
    """What a service kind registers: its settings model and its async entry."""

    kind: str
    settings: type[SettingsT]
    main: Callable[[ServiceContext[SettingsT]], Awaitable[None]]  # returns when done or stopped
    grpc: bool = True  # the launcher waits for gRPC health when True
    # Checks of the machine a load of the run file can make (a program on PATH): (settings,
    # the run file's folder) -> [(key path below settings, problem)]; `rlfleet validate` and
    # `rlfleet up` report them like settings errors.
    check: Callable[[SettingsT, Path], list[tuple[tuple[str | int, ...], str]]] | None = None
    # Whether an instance with these settings talks to NATS. Under `security: {nats_auth: true}`
    # one that does not gets no NATS user at all, so it cannot reach the bus.
    uses_bus: Callable[[SettingsT], bool] = lambda settings: True
    # The instances that must be up before one with these settings may start (`rlfleet up`
    # starts the others at once; services/start_order.py). None: every service listed before
    # it, the safe order for a kind that does not say; `needs_nothing` for a kind that waits
    # for its peers itself, `named_services` for one that calls them as soon as it starts.
    needs: Callable[[SettingsT], Iterable[str]] | None = None
    # Imports (with what they need set first) an instance with these settings makes as it
    # starts: `rlfleet up` runs this while the services it needs come up
    # (services/start_gate.py). The spec's own module stays light: the launcher imports it.
    preload: Callable[[SettingsT], None] = lambda settings: None
    # What training data an instance with these settings feeds the learner ("rollout
    # fragments"), None: none. `rlfleet up` says (and by run.when_producers_gone ends the run)
    # when every producer is gone (launch/producers.py).
    produces: Callable[[SettingsT], str | None] = lambda settings: None
    # What a user of the run needs to reach an instance with these settings once it is healthy
    # (the gateway: its OpenAI base URL and where the API key comes from), None: nothing;
    # `rlfleet up` prints it, as its own internal addresses are of no use outside the run.
    announce: Callable[[SettingsT], str | None] = lambda settings: None
    # Whether an instance with these settings should get CPUs of its own when several such
    # instances run without `cpus` (an engine that binds its threads to the CPUs it sees):
    # `rlfleet up` divides the free CPUs among them (services/placement.py replica_cpus).
    own_cpus: Callable[[SettingsT], bool] = lambda settings: False


def _entry_points(group: str) -> list[metadata.EntryPoint]:
    """Installed entry points of ``group`` (a seam for the duplicate-name test)."""
    return list(metadata.entry_points(group=group))


class EntryPointRegistry(Mapping[str, object]):
    """Names of one entry-point group mapped to their objects, each loaded on first access:
    importing every service kind up front would pull vLLM or DeepSpeed into processes that
    never use them."""

    def __init__(self, group: str, entry_points: Mapping[str, metadata.EntryPoint]) -> None:
        self.group = group
        self._entry_points = dict(entry_points)
        self._loaded: dict[str, object] = {}

    def __getitem__(self, name: str) -> object:
        if name not in self._loaded:
            ep = self._entry_points[name]
            try:
                self._loaded[name] = ep.load()
            except Exception as exc:
                raise ConfigError(
                    f"'{name}' in entry-point group '{self.group}' ({ep.value}) failed to load: "
                    f"{type(exc).__name__}: {exc}"
                ) from exc
        return self._loaded[name]

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._entry_points))

    def __len__(self) -> int:
        return len(self._entry_points)

    def target(self, name: str) -> str:
        """The ``module:attr`` a name points at, without loading it."""
        return self._entry_points[name].value


def _origin(ep: metadata.EntryPoint) -> str:
    dist = getattr(ep, "dist", None)
    return f"{ep.value} from {dist.name}" if dist is not None else ep.value


@functools.cache
def entry_point_registry(group: str) -> EntryPointRegistry:
    """The shared loader of every ``rlfleet.*`` plugin group. Two packages registering the
    same name is an error: silently picking one would depend on install order."""
    found: dict[str, metadata.EntryPoint] = {}
    for ep in _entry_points(group):
        previous = found.get(ep.name)
        # The same target seen twice is one package found on two sys.path entries, not a clash.
        if previous is not None and previous.value != ep.value:
            raise ConfigError(
                f"'{ep.name}' is registered twice in entry-point group '{group}': "
                f"{_origin(previous)} and {_origin(ep)}"
            )
        found[ep.name] = ep
    return EntryPointRegistry(group, found)


def service_kinds() -> list[str]:
    """Names of every installed service kind."""
    return list(entry_point_registry(SERVICES_GROUP))


SpecT = TypeVar("SpecT", "ServiceSpec[Any]", "JobSpec[Any]")


def _spec(group: str, what: str, kind: str, spec_type: type[SpecT]) -> SpecT:
    """The object registered as ``kind`` in ``group``; it must be a ``spec_type`` of that kind.
    Unknown kinds are a ConfigError listing the known ones and the closest match."""
    registry = entry_point_registry(group)
    if kind not in registry:
        close = difflib.get_close_matches(kind, list(registry), n=1)
        hint = f"did you mean '{close[0]}'? " if close else ""
        known = ", ".join(registry) or "none installed"
        raise ConfigError(f"unknown {what} kind '{kind}' ({hint}known: {known})")
    spec = registry[kind]
    if not isinstance(spec, spec_type) or spec.kind != kind:
        raise ConfigError(
            f"entry point '{kind}' ({registry.target(kind)}) is not a "
            f"{spec_type.__name__} of kind '{kind}'"
        )
    return spec


def get_service(kind: str) -> ServiceSpec[Any]:
    """The ServiceSpec registered as ``kind`` in ``rlfleet.services`` (its settings type is
    only known at run time, hence ``Any``)."""
    return _spec(SERVICES_GROUP, "service", kind, ServiceSpec)


@dataclass(frozen=True)
class JobSpec(Generic[SettingsT]):
    """A job kind: flat, user-facing knobs (``job:`` in a run file) and how they expand into
    service entries (dicts shaped like ``services:`` items). Expansion must be deterministic:
    every ``rlfleet serve`` of the run re-reads the same file and expands it again.

    ``prepare`` (optional) runs once in ``rlfleet up`` before any service starts, for what the
    services need on disk (e.g. a local model that ``init-model`` creates when it is missing);
    it must be idempotent."""

    kind: str
    settings: type[SettingsT]
    # (settings, run name) -> service entries
    expand: Callable[[SettingsT, str], list[dict[str, Any]]]
    prepare: Callable[[SettingsT, Path], None] | None = None  # (settings, run dir)
    # How a finished or training run of this kind is tried out (the studio's "watch and
    # try"): "episode" (`rlfleet play --video`), "prompt" (`rlfleet ask`), None (nothing).
    watch: Literal["episode", "prompt"] | None = None


def get_job(kind: str) -> JobSpec[Any]:
    """The JobSpec registered as ``kind`` in ``rlfleet.jobs``."""
    return _spec(JOBS_GROUP, "job", kind, JobSpec)


@dataclass
class ServiceContext(Generic[SettingsT]):
    """Everything a running service needs to know about its place in the run; ``settings`` is
    an instance of its kind's settings model (``ServiceContext[MySettings]``)."""

    name: str
    kind: str
    settings: SettingsT
    run_name: str = "local"
    run_dir: Path = Path("runs/local")
    host: str = "127.0.0.1"
    port: int = 0  # where to bind gRPC; 0 = let the OS pick
    metrics_port: int | None = None
    nats_url: str | None = None
    endpoints: dict[str, str] = field(default_factory=dict)  # instance name -> "host:port"
    config_dir: Path = field(default_factory=Path.cwd)  # the run file's folder
    # The run file the settings came from (the run dir's copy under `rlfleet up`), for what a
    # service reads of the run beyond its own settings (the learner: run.tracking); None: none.
    config_path: Path | None = None
    stop_event: asyncio.Event = field(default_factory=asyncio.Event)  # set on SIGTERM/SIGINT
    # This process's own identity among replicas of the instance `name` (metric labels, session
    # ids); "": `name` itself, as `rlfleet up` runs one process per instance (replica_name).
    replica: str = ""

    def __post_init__(self) -> None:
        self.replica = self.replica or self.name

    def resolve(self, name_or_address: str) -> str:
        """The address of a service instance name, or ``host:port`` unchanged, so settings can
        name peers (``env_servers: [env-a]``) while the launcher chooses ports at start."""
        if name_or_address in self.endpoints:
            return self.endpoints[name_or_address]
        if ":" in name_or_address:
            return name_or_address
        known = ", ".join(sorted(self.endpoints)) or "none"
        raise ConfigError(f"unknown service '{name_or_address}' (known endpoints: {known})")

    @classmethod
    def from_environment(
        cls,
        kind: str,
        settings: SettingsT,
        *,
        name: str | None = None,
        host: str | None = None,
        port: int | None = None,
        config: str | os.PathLike[str] | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> ServiceContext[SettingsT]:
        """Build the context from CLI flags and the ``RLFLEET_*`` variables the launcher (or a
        container spec) sets; unset values fall back to a standalone local service. ``config``:
        the run file the settings came from (else ``$RLFLEET_RUN_CONFIG``)."""
        env = os.environ if environ is None else environ
        config = config or env.get(ENV_RUN_CONFIG) or None
        run_name = env.get(ENV_RUN_NAME) or "local"
        try:
            endpoints = json.loads(env.get(ENV_ENDPOINTS) or "{}")
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{ENV_ENDPOINTS}: not valid JSON: {exc}") from None
        if not isinstance(endpoints, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in endpoints.items()
        ):
            raise ConfigError(f'{ENV_ENDPOINTS}: must be a JSON object {{"name": "host:port"}}')
        metrics = env.get(ENV_METRICS_PORT) or None
        if metrics is not None and not metrics.isdigit():
            raise ConfigError(f"{ENV_METRICS_PORT}: not a port number: {metrics!r}")
        return cls(
            name=name or kind,
            kind=kind,
            settings=settings,
            run_name=run_name,
            run_dir=Path(env.get(ENV_RUN_DIR) or Path("runs") / run_name),
            host=host or "127.0.0.1",
            port=port or 0,
            metrics_port=int(metrics) if metrics is not None else None,
            nats_url=env.get(ENV_NATS_URL) or None,
            endpoints=endpoints,
            config_dir=Path(env.get(ENV_CONFIG_DIR) or Path.cwd()),
            config_path=Path(config) if config is not None else None,
            replica=replica_name(name or kind, env),
        )


def replica_name(name: str, environ: Mapping[str, str], hostname: str | None = None) -> str:
    """The identity of this process among the replicas of instance ``name``.

    Replicas scaled from one spec (``docker compose --scale``, a Deployment) share the spec's
    environment and ``--name``, which picks their settings in the run file; their metrics and
    session ids still need to tell them apart. ``RLFLEET_REPLICA_NAME`` unset or empty: ``name``
    (one process per instance, as ``rlfleet up`` runs them); else its value, with ``{name}``
    replaced by the instance name and ``{hostname}`` by this host's name (a container's own:
    its id in compose, the pod name in Kubernetes), e.g. ``{name}@{hostname}``."""
    template = environ.get(ENV_REPLICA_NAME, "").strip()
    if not template:
        return name
    host = hostname if hostname is not None else socket.gethostname()
    return template.replace("{name}", name).replace("{hostname}", host)
