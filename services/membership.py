"""Membership: which replicas of a run's services are live, and where to reach them.

Every replica of a kind that others call (env servers, samplers, reward services) registers in
the run's membership bucket, a JetStream key-value bucket (`members_bucket`), under one key of
its own (`Registration`): its kind, instance name, replica name, the address others dial, its
load and its state (serving, or draining before it stops). It puts its record again every
`HEARTBEAT_S`; a clean stop deletes the key. The bucket keeps no record older than `EXPIRY_S`,
and a watcher (`Members`) forgets a record not refreshed within it, so a killed replica drops
out within that time without anyone deleting its key.

Consumers name their peers as before (`env_servers: [env-0]`); `PeerView` turns the names into
addresses: an instance name means every live, serving replica of that instance (so a replica
added with `docker compose --scale` or a Kubernetes scale-up is used as soon as it registers,
and one that leaves is dropped), a ``host:port`` means that address only (explicit lists stay
possible), and without a bus the launcher's endpoints are used as they always were.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import itertools
import json
import logging
import os
import re
import socket
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any, Generic, TypeVar
from urllib.parse import urlsplit

from services.bus import Bus
from services.bus.subjects import members_bucket
from services.errors import ConfigError, Unavailable
from services.registry import ServiceContext

__all__ = [
    "ENV_ADVERTISE_HOST",
    "EXPIRY_S",
    "HEARTBEAT_S",
    "Balancer",
    "Member",
    "Members",
    "PeerView",
    "Registration",
    "advertised_address",
    "ensure_bucket",
    "registered",
]

log = logging.getLogger(__name__)

HEARTBEAT_S = 1.0  # how often a replica puts its record again
EXPIRY_S = 10.0  # a record not refreshed for this long is a dead replica's
STALE_VIEW_EXPIRY_S = 3 * EXPIRY_S  # the same when no record at all was refreshed meanwhile
# The host (name or address) others dial to reach this replica, where the bind address is a
# wildcard and the address NATS sees is not the right one (a pod's IP from the downward API).
ENV_ADVERTISE_HOST = "RLFLEET_ADVERTISE_HOST"

SERVING, DRAINING = "serving", "draining"
_WILDCARDS = {"", "0.0.0.0", "::", "[::]"}
_KEY_UNSAFE = re.compile(r"[^A-Za-z0-9_=-]")


@dataclass(frozen=True)
class Member:
    """One replica's record in the membership bucket."""

    kind: str  # service kind: env_server, sampler, reward_service
    name: str  # instance name, shared by the replicas of one spec
    replica: str  # this replica's own name (services.registry.replica_name)
    address: str  # host:port to dial
    state: str = SERVING  # or DRAINING: finishing what it holds, taking nothing new
    load: int = 0  # what it holds now, in the kind's own unit (envs, streams, calls)
    key: str = ""  # its key in the bucket

    def encode(self) -> bytes:
        return json.dumps(asdict(self), separators=(",", ":")).encode()

    @classmethod
    def decode(cls, key: str, raw: bytes) -> Member | None:
        """The record under ``key``; None when it is not one (a foreign or damaged value)."""
        try:
            fields = json.loads(raw)
            return cls(
                kind=str(fields["kind"]),
                name=str(fields["name"]),
                replica=str(fields["replica"]),
                address=str(fields["address"]),
                state=str(fields.get("state", SERVING)),
                load=int(fields.get("load", 0)),
                key=key,
            )
        except (ValueError, KeyError, TypeError):
            return None


def advertised_address(bind_host: str, port: int, nats_url: str | None) -> str:
    """The ``host:port`` others dial to reach a server bound to ``bind_host``:``port``.

    ``$RLFLEET_ADVERTISE_HOST`` when set; else the bind host unless it is a wildcard; else the
    local address this host uses towards NATS (the network the run's services share), or the
    host name when that cannot be found."""
    host = os.environ.get(ENV_ADVERTISE_HOST, "").strip()
    if not host and bind_host not in _WILDCARDS:
        host = bind_host
    if not host:
        host = _address_towards(nats_url) or socket.gethostname()
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{host}:{port}"


def _address_towards(nats_url: str | None) -> str | None:
    """This host's address on the route to the first NATS server (a UDP connect sends
    nothing); loopback when NATS is on loopback."""
    if not nats_url:
        return None
    target = urlsplit(nats_url.split(",")[0].strip())
    if not target.hostname:
        return None
    try:
        if ipaddress.ip_address(target.hostname).is_loopback:
            return target.hostname
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(target.hostname, target.port or 4222, type=socket.SOCK_DGRAM)
        family, _, _, _, sockaddr = infos[0]
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect(sockaddr)
            return str(probe.getsockname()[0])
    except OSError:
        return None


async def ensure_bucket(bus: Bus, run: str) -> Any:
    """The run's membership bucket, created when missing (by the launcher under NATS auth,
    where services may not create buckets)."""
    return await bus.kv(members_bucket(run), ttl_s=EXPIRY_S)


def _key(kind: str, replica: str) -> str:
    """A bucket key of its own for one replica process (replicas may share a name)."""
    return f"{kind}.{_KEY_UNSAFE.sub('_', replica)[:80]}-{uuid.uuid4().hex[:8]}"


class Registration:
    """This replica's record in the run's membership bucket, refreshed while it runs.

        async with Registration(bus, run, member, load=lambda: service.envs_held):
            ...  # serving
        # the key is deleted on leaving (drain() first, to let consumers move away)

    ``bus`` is a connected Bus, or a NATS url this registration connects to (and closes)
    itself. Registering never holds the service up or fails it: until NATS (or the bucket)
    answers, the heartbeat keeps trying, and consumers use fixed endpoints meanwhile.
    """

    def __init__(
        self,
        bus: Bus | str,
        run: str,
        member: Member,
        *,
        load: Callable[[], int] | None = None,
    ) -> None:
        self.bus = bus if isinstance(bus, Bus) else None
        self._url = bus if isinstance(bus, str) else None
        self.run = run
        self.member = replace(member, key=member.key or _key(member.kind, member.replica))
        self._load = load
        self._task: asyncio.Task[None] | None = None
        self._stopping = asyncio.Event()
        self._kv: Any = None
        self._failing: str | None = None  # the last failure logged, so each is logged once

    async def start(self) -> None:
        """Register now if the bus answers, and keep the record fresh in the background."""
        await self._beat_once()
        self._task = asyncio.create_task(self._beat(), name=f"membership {self.member.key}")

    async def _beat_once(self) -> None:
        try:
            if self.bus is None:
                assert self._url is not None
                name = f"{self.member.replica}-membership"
                self.bus = await Bus.connect(self._url, name=name, connect_attempts=1)
            if self._kv is None:
                self._kv = await ensure_bucket(self.bus, self.run)
            await self._put()
        except Exception as exc:  # NATS away for a while: the next beat tries again
            if str(exc) != self._failing:
                log.warning("membership record of %s not stored: %s", self.member.replica, exc)
            self._failing = str(exc)
            return
        if self._failing is not None or not self._task:
            log.info(
                "%s %s registered as %s at %s",
                self.member.kind,
                self.member.replica,
                self.member.key,
                self.member.address,
            )
        self._failing = None

    async def _put(self) -> None:
        if self._load is not None:
            self.member = replace(self.member, load=int(self._load()))
        await self._kv.put(self.member.key, self.member.encode())

    async def _beat(self) -> None:
        # Ends on `_stopping` too: a cancellation that lands as a put's reply arrives can be
        # lost inside nats-py's wait_for, and the loop must not outlive stop().
        while not self._stopping.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), HEARTBEAT_S)
            if self._stopping.is_set():
                return
            await self._beat_once()

    async def drain(self, done: Callable[[], bool], timeout_s: float) -> bool:
        """Say this replica is draining, then wait until ``done()`` (what it held has moved
        elsewhere) or ``timeout_s``; whether it drained."""
        self.member = replace(self.member, state=DRAINING)
        if self._kv is not None:
            with contextlib.suppress(Exception):
                await self._put()
        deadline = time.monotonic() + timeout_s
        while not done():
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.1)
        return True

    async def stop(self) -> None:
        """Stop the heartbeat and delete the record (best effort: expiry covers the rest)."""
        task, self._task = self._task, None
        self._stopping.set()
        if task is not None:
            task.cancel()
            timeout = (self.bus.request_timeout_s if self.bus else 5.0) + HEARTBEAT_S
            await asyncio.wait({task}, timeout=timeout)
        if self._kv is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._kv.delete(self.member.key), 2.0)
        if self._url is not None and self.bus is not None:  # a connection of its own
            with contextlib.suppress(Exception):
                await self.bus.close()

    async def __aenter__(self) -> Registration:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()


@contextlib.asynccontextmanager
async def registered(
    ctx: ServiceContext[Any], port: int, *, load: Callable[[], int] | None = None
) -> AsyncIterator[Registration | None]:
    """This service's registration while the block runs (on a bus connection of its own);
    None when the service runs without a bus (no ``RLFLEET_NATS_URL``): consumers then use
    fixed addresses. The record is deleted on leaving the block."""
    if not ctx.nats_url:
        yield None
        return
    member = Member(
        kind=ctx.kind,
        name=ctx.name,
        replica=ctx.replica,
        address=advertised_address(ctx.host, port, ctx.nats_url),
    )
    async with Registration(ctx.nats_url, ctx.run_name, member, load=load) as registration:
        yield registration


class Members:
    """A live view of the run's membership bucket: ``live(kind)``, and ``version`` that grows
    at every change, so consumers can compare it cheaply on every step."""

    def __init__(self, bus: Bus, run: str) -> None:
        self.bus = bus
        self.run = run
        self.version = 0
        self._records: dict[str, tuple[Member, float]] = {}  # key -> (record, last seen)
        self._tasks: list[asyncio.Task[None]] = []
        self._watcher: Any = None

    async def start(self) -> None:
        """Watch the bucket; returns once the current records are in."""
        kv = await ensure_bucket(self.bus, self.run)
        self._watcher = await kv.watchall()
        while True:  # the current records, then None once they are all in
            entry = await self._watcher.updates(timeout=self.bus.request_timeout_s)
            if entry is None:
                break
            self._apply(entry)
        self._tasks = [
            asyncio.create_task(self._follow(), name="membership watch"),
            asyncio.create_task(self._expire(), name="membership expiry"),
        ]

    def _apply(self, entry: Any) -> None:
        if entry.operation in ("DEL", "PURGE") or entry.value is None:
            if self._records.pop(entry.key, None) is not None:
                self._bump()
            return
        member = Member.decode(entry.key, entry.value)
        if member is None:
            return
        old = self._records.get(entry.key)
        self._records[entry.key] = (member, time.monotonic())
        if old is None or _shape(old[0]) != _shape(member):
            self._bump()

    def _bump(self) -> None:
        self.version += 1

    async def _follow(self) -> None:
        # The watcher's iterator, not updates(timeout): its wait_for can lose a cancellation,
        # and close() ends the iteration by stopping the watcher.
        async for entry in self._watcher:
            if entry is not None:
                self._apply(entry)

    async def _expire(self) -> None:
        while True:
            await asyncio.sleep(HEARTBEAT_S)
            if not self._records or not self.bus.nc.is_connected:
                continue  # our own connection is down: nobody's silence means anything yet
            now = time.monotonic()
            newest = max(seen for _, seen in self._records.values())
            # Every record stale at once is more likely the bus (a bucket leader being
            # re-elected, this watch lagging) than every replica dead: wait longer then.
            horizon = EXPIRY_S if now - newest < EXPIRY_S else STALE_VIEW_EXPIRY_S
            dead = [key for key, (_, seen) in self._records.items() if seen < now - horizon]
            for key in dead:
                member = self._records.pop(key)[0]
                log.info("%s %s (%s) missed its heartbeats", member.kind, member.replica, key)
            if dead:
                self._bump()

    def live(self, kind: str, name: str | None = None, *, serving: bool = True) -> list[Member]:
        """Live records of ``kind`` (of instance ``name``), serving ones only by default."""
        return sorted(
            (
                m
                for m, _ in self._records.values()
                if m.kind == kind
                and (name is None or m.name == name)
                and (not serving or m.state == SERVING)
            ),
            key=lambda m: (m.name, m.address, m.key),
        )

    def load(self, address: str) -> int:
        """The load the replica at ``address`` last reported (0 when unknown)."""
        return sum(m.load for m, _ in self._records.values() if m.address == address)

    async def close(self) -> None:
        if self._watcher is not None:  # ends _follow's iteration
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._watcher.stop(), self.bus.request_timeout_s)
        for task in self._tasks:
            task.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=self.bus.request_timeout_s)


def _shape(member: Member) -> tuple[str, str, str]:
    """What consumers route by; a load change alone is not a membership change."""
    return member.name, member.address, member.state


class PeerView:
    """The addresses a consumer's peer settings name, kept current.

    ``refs`` are instance names or ``host:port``. Following `Members`, an instance name stands
    for every live serving replica of that instance, in a stable order, and for the launcher's
    (or compose's) endpoint of that name while none has registered (a server run without a
    bus, or one restarting); without `Members`, for that endpoint only.
    """

    def __init__(
        self,
        refs: Sequence[str],
        *,
        kind: str,
        resolve: Callable[[str], str],
        members: Members | None = None,
    ) -> None:
        if not refs:
            raise ConfigError(f"no {kind} named: name at least one instance or host:port")
        self.refs = list(refs)
        self.kind = kind
        self.members: Members | None = None
        # Whether the addresses can change (some name follows the membership); read every step.
        self.dynamic = False
        self._endpoints: dict[str, str | None] = {}
        self._unknown: ConfigError | None = None  # a name without endpoint, until following
        for ref in self.refs:
            try:
                self._endpoints[ref] = resolve(ref)
            except ConfigError as exc:
                self._endpoints[ref] = None  # known only once it registers
                self._unknown = self._unknown or exc
        if members is not None:
            self.follow(members)

    def follow(self, members: Members) -> None:
        """Follow ``members`` from now on (instance names become their live replicas)."""
        self.members = members
        self.dynamic = not all(map(_is_address, self.refs))

    @property
    def version(self) -> int:
        return self.members.version if self.members is not None else 0

    def addresses(self) -> list[str]:
        """The addresses to use now, without duplicates, in the order of ``refs``. Raises the
        ConfigError of a name that has no endpoint when not following the membership."""
        if self.members is None and self._unknown is not None:
            raise self._unknown
        out: list[str] = []
        for ref in self.refs:
            live = []
            if self.members is not None and not _is_address(ref):
                live = [m.address for m in self.members.live(self.kind, ref)]
            endpoint = self._endpoints[ref]
            out.extend(live or ([endpoint] if endpoint else []))
        return list(dict.fromkeys(out))

    def load(self, address: str) -> int:
        return self.members.load(address) if self.members is not None else 0

    def registered(self, address: str) -> bool:
        """Whether ``address`` is a replica's registered one (not a fixed address or an
        endpoint): such a replica may be replaced by others when it fails."""
        if self.members is None:
            return False
        return any(m.address == address for m in self.members.live(self.kind, serving=False))

    async def wait(self, stop: asyncio.Event, timeout_s: float) -> list[str]:
        """The addresses once there is at least one; raises Unavailable after ``timeout_s``
        with none, returns [] when ``stop`` is set meanwhile."""
        deadline = time.monotonic() + timeout_s
        while not (found := self.addresses()):
            left = deadline - time.monotonic()
            if left <= 0:
                raise Unavailable(
                    f"no live {self.kind} for {', '.join(self.refs)} after {timeout_s:g}s "
                    "(none registered in the run's membership bucket)"
                )
            if stop.is_set() or self.members is None:
                return []
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), min(left, 0.2))
        return found


def _is_address(ref: str) -> bool:
    return ":" in ref


ClientT = TypeVar("ClientT")


class Balancer(Generic[ClientT]):
    """One client per replica a `PeerView` names, kept in step with it: a call goes to the
    replica with the fewest of this process's calls in flight (ties in turn), so replicas that
    join take work at once and those that leave get none.

        async with balancer.use() as (address, client):
            await client.call(...)
    """

    def __init__(
        self,
        peers: PeerView,
        connect: Callable[[str], ClientT],
        close: Callable[[ClientT], Awaitable[None]],
    ) -> None:
        self.peers = peers
        self._connect = connect
        self._close = close
        self._clients: dict[str, ClientT] = {}
        self._in_flight: dict[str, int] = {}
        self._retired: list[tuple[str, ClientT]] = []  # gone replicas, closed once idle
        self._version = -1
        self._turn = itertools.count()

    def _sync(self) -> None:
        if self._version == self.peers.version and self._clients:
            return
        self._version = self.peers.version
        live = self.peers.addresses()
        for address in [a for a in self._clients if a not in live]:
            self._retired.append((address, self._clients.pop(address)))
        for address in live:
            if address not in self._clients:
                self._clients[address] = self._connect(address)
                self._in_flight.setdefault(address, 0)

    @property
    def addresses(self) -> list[str]:
        """The replicas in use now."""
        self._sync()
        return list(self._clients)

    def client(self, address: str) -> ClientT:
        self._sync()
        return self._clients[address]

    @contextlib.asynccontextmanager
    async def use(self) -> AsyncIterator[tuple[str, ClientT]]:
        """The least busy replica's (address, client) for one call."""
        self._sync()
        if not self._clients:
            raise Unavailable(f"no live {self.peers.kind} for {', '.join(self.peers.refs)}")
        candidates = list(self._clients)
        turn = next(self._turn) % len(candidates)
        rotated = candidates[turn:] + candidates[:turn]
        address = min(rotated, key=lambda a: self._in_flight[a])
        client = self._clients[address]
        self._in_flight[address] += 1
        try:
            yield address, client
        finally:
            self._in_flight[address] -= 1
            await self._close_idle()

    async def _close_idle(self) -> None:
        idle = [(a, c) for a, c in self._retired if not self._in_flight.get(a)]
        self._retired = [(a, c) for a, c in self._retired if self._in_flight.get(a)]
        for _, client in idle:
            with contextlib.suppress(Exception):
                await self._close(client)

    async def close(self) -> None:
        clients = [*self._clients.values(), *(c for _, c in self._retired)]
        self._clients, self._retired = {}, []
        await asyncio.gather(*(self._close(c) for c in clients), return_exceptions=True)
