"""An actor's environments: sessions on env servers, stepped as one batch.

The actor's N envs are columns [0, N). Each part of them (one, or two double-buffered) is split
over the env servers in use, contiguously and as evenly as possible (server j holds columns
[start_j, stop_j)). Each tick sends every server its slice of the actions concurrently and
writes the answers straight into the caller's preallocated rows, so nothing per env runs in
Python.

Double-buffered (sampler/actors/sampling.py), the envs form two parts, the first and second
half of the columns, each with its own sessions; `step(..., part=p)` steps one part's sessions,
leaving the other part free to be inferred on meanwhile.

Which servers: the actor's `PeerView` (services/membership.py). Where an instance name follows
the run's membership, servers that join are used and servers that leave or die are dropped
without restarting the actor: after a tick that saw the membership change, the part is laid out
again over the servers live now. Columns whose session moves are recorded as truncated at the
observation the tick produced (bootstrapped from it, so no fragment is lost) and start new
episodes on their new server; columns whose server and range stay keep their session.

A server that drops its stream (restart, network fault, request timeout) must not end the run:
its envs' step at that tick is recorded as truncated at the observation they were in (reward 0,
bootstrapped from that observation). Following the membership, the server is set aside for a
while and its columns move to the others (when there are none, or with fixed addresses, the
session is recreated on it with backoff). Errors that are the request's fault (bad action,
unknown env id) are raised.

A server on this host is offered the co-located fast path (docs/colocated.md) at every session
(re)creation unless `colocated="off"`; each link's transport is in its `transport`, in the
`rlfleet_actor_env_links{actor, transport}` gauge and in the actor's log lines.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np

from clients.env import EnvSession, SessionInfo, StepResult
from services.errors import InvalidArgument, RlfleetError, Unavailable, code_of
from services.membership import EXPIRY_S, HEARTBEAT_S, PeerView
from services.telemetry import metrics

__all__ = ["EnvGroup", "Link", "StepOut", "TickEvents"]

log = logging.getLogger(__name__)

_LINKS = metrics.gauge(
    "actor_env_links",
    "A game actor's env server sessions by transport: shm (co-located ring) or grpc.",
    ("actor", "transport"),
)
TRANSPORTS = ("shm", "grpc")

MAX_CONSECUTIVE_DROPS = 5  # a step that fails on every new session is not a hiccup
MISCONFIGURED_SET_ASIDE_S = 60.0  # a replica that refused a session for a reason of its own

# Codes after which a new session may work: the server went away, restarts, or is full for now.
_TRANSIENT = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.ABORTED,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
}


def is_transient(exc: BaseException) -> bool:
    """Whether recreating the session is worth trying after `exc`."""
    return isinstance(exc, RlfleetError) and code_of(exc) in _TRANSIENT


@dataclass
class Link:
    """One env server's session and the slice of the actor's envs it holds."""

    address: str
    start: int
    stop: int
    seed: int | None
    session: EnvSession | None = None
    info: SessionInfo | None = None
    reconnects: int = 0
    failures: int = 0  # drops since the last good step
    transport: str = ""  # "shm" or "grpc" once connected (EnvSession.transport)

    @property
    def num_envs(self) -> int:
        return self.stop - self.start


@dataclass
class StepOut:
    """Rows one tick writes: views into the caller's buffers, leading dimension N."""

    next_obs: np.ndarray
    rewards: np.ndarray
    terminated: np.ndarray
    truncated: np.ndarray


@dataclass
class TickEvents:
    """What happened at one tick besides the rows: ended episodes and truncation finals."""

    # (global env index, return, length, truncated, score or None) of episodes the servers saw end
    episodes: list[tuple[int, float, int, bool, float | None]] = field(default_factory=list)
    # global env indices [K] truncated at this tick, and their last observations [K, ...]
    final_indices: list[np.ndarray] = field(default_factory=list)
    final_obs: list[np.ndarray] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)  # addresses whose session was recreated


class EnvGroup:
    """N envs of one env id over the env servers `peers` names, SAME_STEP autoreset, Box
    observations."""

    def __init__(
        self,
        peers: PeerView | Sequence[str],
        num_envs: int,
        env_id: str,
        *,
        env_kwargs: dict[str, Any] | None = None,
        seed: int | None = None,
        request_timeout_s: float = 30.0,
        reconnect_timeout_s: float = 60.0,
        stop_event: asyncio.Event | None = None,
        colocated: str = "auto",
        colocated_busy_poll_us: int = 0,
        colocated_block_us: int = 0,
        double_buffer: bool = False,
        name: str = "actor",
    ) -> None:
        if double_buffer and num_envs < 2:
            raise InvalidArgument("double buffering needs at least 2 envs", field="num_envs")
        if not isinstance(peers, PeerView):  # fixed host:port addresses
            peers = PeerView(list(peers), kind="env_server", resolve=str)
        self.peers = peers
        self.num_envs = num_envs
        self.env_id = env_id
        self.seed = seed
        self.colocated = colocated  # "auto" or "off"
        self.colocated_busy_poll_us = colocated_busy_poll_us
        self._block_us = colocated_block_us
        self.double_buffer = double_buffer
        self.name = name  # the actor's, for the metric
        self.env_kwargs = dict(env_kwargs or {})
        self.request_timeout_s = request_timeout_s
        self.reconnect_timeout_s = reconnect_timeout_s
        self.stop_event = stop_event or asyncio.Event()
        half = (num_envs + 1) // 2
        halves = [slice(0, half), slice(half, num_envs)]
        self.parts = halves if double_buffer else [slice(0, num_envs)]
        self.part_links: list[list[Link]] = [[] for _ in self.parts]
        self._layout_version = [-1 for _ in self.parts]  # peers.version each part follows
        self._set_aside: dict[str, float] = {}  # address -> until (monotonic) after a drop
        self.observation_space: Any = None
        self.action_space: Any = None

    @property
    def links(self) -> list[Link]:
        return [link for part in self.part_links for link in part]

    @property
    def addresses(self) -> str:
        return ",".join(link.address for link in self.links)

    @property
    def transports(self) -> str:
        """Each link's transport, in column order (for logs)."""
        return ",".join(link.transport or "-" for link in self.links)

    @property
    def colocated_block_us(self) -> int:
        # Blocking waits only for a lone session: steps of several are awaited together.
        lone = len(self.links) == 1 and not self.double_buffer
        return self._block_us if lone else 0

    def _count_transports(self) -> None:
        for transport in TRANSPORTS:
            count = sum(link.transport == transport for link in self.links)
            _LINKS.labels(self.name, transport).set(count)

    @property
    def session_ids(self) -> str:
        return ",".join(link.info.session_id if link.info else "" for link in self.links)

    async def open(self) -> np.ndarray | None:
        """Lay every part out over the servers live now, create and reset every session
        (retrying transient failures): the first observations of all N envs, or None when
        told to stop meanwhile."""
        if not await self.peers.wait(self.stop_event, self.reconnect_timeout_s):
            return None
        for part in range(len(self.parts)):
            self._layout_version[part] = self.peers.version
            self.part_links[part] = self._layout(part, self._usable())
        firsts = await asyncio.gather(*(self._connect(link, seeded=True) for link in self.links))
        if not all(isinstance(first, np.ndarray) for first in firsts):
            return None  # told to stop
        obs = np.empty((self.num_envs, *self.observation_space.shape), self.observation_space.dtype)
        for link, first in zip(self.links, firsts, strict=True):
            obs[link.start : link.stop] = first
        return obs

    def _usable(self) -> list[str]:
        """The servers to lay columns over now: the live ones, less those set aside after a
        drop (all of them when that leaves none)."""
        live = self.peers.addresses()
        now = time.monotonic()
        self._set_aside = {a: until for a, until in self._set_aside.items() if until > now}
        usable = [a for a in live if a not in self._set_aside]
        return usable or live

    def _layout(self, part: int, addresses: list[str]) -> list[Link]:
        """The part's columns over ``addresses``: servers the part uses now first, in their
        order (so an unchanged split keeps its sessions), then new ones; at most one server
        per column, the least loaded when there are more servers than columns."""
        cols = self.parts[part]
        size = cols.stop - cols.start
        current = [link.address for link in self.part_links[part]]
        ordered = list(dict.fromkeys(a for a in current if a in addresses))
        ordered += [a for a in addresses if a not in current]
        if len(ordered) > size:
            keep = sorted(ordered, key=lambda a: (a not in current, self.peers.load(a)))[:size]
            ordered = [a for a in ordered if a in keep]
        share, extra = divmod(size, len(ordered))
        links, start = [], cols.start
        for j, address in enumerate(ordered):
            count = share + (j < extra)
            link_seed = None if self.seed is None else self.seed + start
            links.append(Link(address, start, start + count, link_seed))
            start += count
        return links

    def _needs_layout(self, part: int) -> bool:
        if not self.peers.dynamic:
            return False
        if self._layout_version[part] != self.peers.version:
            return True
        return bool(self._set_aside) and min(self._set_aside.values()) <= time.monotonic()

    async def step(
        self, actions: np.ndarray, obs: np.ndarray, out: StepOut, part: int = 0
    ) -> TickEvents:
        """Step the part's envs with their rows of `actions`; `obs` are the observations acted
        on. All arrays are whole rows [N, ...]: only the part's columns are read or written."""
        events = TickEvents()
        links = self.part_links[part]
        # Link 0 is stepped inline, only the others as tasks: one task fewer per tick than
        # asyncio.gather, which matters at a few hundred microseconds per tick.
        others = [asyncio.ensure_future(_step(link, actions)) for link in links[1:]]
        try:
            results = [await _step(links[0], actions)]
            for task in others:
                results.append(await task)
        finally:
            for task in others:
                task.cancel()  # only matters when cancelled half way
        dropped: list[Link] = []
        for link, result in zip(links, results, strict=True):
            if isinstance(result, BaseException):
                link.failures += 1
                if not is_transient(result) or link.failures > MAX_CONSECUTIVE_DROPS:
                    raise result
                self._truncate_dropped(link, result, obs, out, events)
                dropped.append(link)
            else:
                if link.failures:
                    link.failures = 0
                _write(link, result, out, events)
        for link in dropped:
            link.reconnects += 1
            if self.peers.registered(link.address):  # a replica: others may take its envs
                self._set_aside[link.address] = time.monotonic() + EXPIRY_S + HEARTBEAT_S
                if await self._rehome(part, link, out):
                    continue
            first = await self._connect(link, seeded=False)
            if isinstance(first, np.ndarray):
                out.next_obs[link.start : link.stop] = first
        if self._needs_layout(part):
            await self._relayout(part, out, events)
        return events

    async def _rehome(self, part: int, link: Link, out: StepOut) -> bool:
        """Move a failed link's envs to a session on another server, the least loaded first;
        whether one took them."""
        others = [a for a in self._usable() if a != link.address and a not in self._set_aside]
        for address in sorted(others, key=self.peers.load):
            moved = Link(address, link.start, link.stop, None, reconnects=link.reconnects)
            first = await self._connect(moved, seeded=False, once=True)
            if first is None:
                return True  # told to stop
            if isinstance(first, np.ndarray):
                await self._close_link(link)
                links = self.part_links[part]
                links[links.index(link)] = moved
                out.next_obs[link.start : link.stop] = first
                log.info(
                    "%s: envs %d-%d moved to %s", self.name, link.start, link.stop - 1, address
                )
                return True
            if isinstance(first, Exception):
                self._set_aside_after(address, first)
        return False

    def _set_aside_after(self, address: str, exc: Exception) -> None:
        """A server that would not take a session is left out of layouts for a while: longer
        when the fault is its own (it does not know the env id, refuses the arguments), so a
        misconfigured replica never takes the run down while others serve."""
        transient = is_transient(exc)
        hold = EXPIRY_S if transient else MISCONFIGURED_SET_ASIDE_S
        (log.info if transient else log.error)(
            "env server %s: no session (%s); left out for %gs", address, exc, hold
        )
        self._set_aside[address] = time.monotonic() + hold

    def _truncate_dropped(
        self, link: Link, exc: BaseException, obs: np.ndarray, out: StepOut, events: TickEvents
    ) -> None:
        """Record the link's envs as truncated where they stood (its step failed)."""
        rows = slice(link.start, link.stop)
        log.warning("env server %s: %s; its envs start new sessions", link.address, exc)
        out.rewards[rows] = 0.0
        out.terminated[rows] = False
        out.truncated[rows] = True
        out.next_obs[rows] = obs[rows]
        events.final_indices.append(np.arange(link.start, link.stop))
        events.final_obs.append(np.array(obs[rows]))
        events.dropped.append(link.address)

    async def _relayout(self, part: int, out: StepOut, events: TickEvents) -> None:
        """Lay the part out again over the servers usable now, after its tick was written:
        columns whose session moves end their episode there (truncated at the observation the
        tick produced) and get the reset observations of their new session."""
        version = self.peers.version
        old = self.part_links[part]
        for _ in range(len(old) + len(self.peers.addresses()) + 1):
            new = self._layout(part, self._usable())
            kept = {
                (link.address, link.start, link.stop): link
                for link in old
                if link.session is not None
            }
            fresh = [link for link in new if (link.address, link.start, link.stop) not in kept]
            firsts = await asyncio.gather(
                *(self._connect(link, seeded=False, once=True) for link in fresh)
            )
            results = zip(fresh, firsts, strict=True)
            failed = [link for link, first in results if isinstance(first, Exception)]
            if failed:  # set those servers aside and lay the part out over the others
                await asyncio.gather(*(self._close_link(link) for link in fresh))
                for link, first in zip(fresh, firsts, strict=True):
                    if isinstance(first, Exception):
                        self._set_aside_after(link.address, first)
                continue
            if any(first is None for first in firsts):
                return  # told to stop
            new_keys = {(link.address, link.start, link.stop) for link in new}
            moved = [link for key, link in kept.items() if key not in new_keys]
            await asyncio.gather(*(self._close_link(link) for link in moved))
            for link, first in zip(fresh, firsts, strict=True):
                assert isinstance(first, np.ndarray)
                _restart_rows(link, first, out, events)
            self.part_links[part] = [kept.get((n.address, n.start, n.stop), n) for n in new]
            self._layout_version[part] = version
            self._count_transports()
            if not fresh:
                return
            log.info(
                "%s: envs %d-%d on %s",
                self.name,
                self.parts[part].start,
                self.parts[part].stop - 1,
                ", ".join(f"{link.address} ({link.num_envs})" for link in self.part_links[part]),
            )
            return
        # Every server tried failed: keep the layout there is, and try again later.
        self._layout_version[part] = version

    async def _connect(
        self, link: Link, *, seeded: bool, once: bool = False
    ) -> np.ndarray | BaseException | None:
        """(Re)create the link's session with backoff; its reset observations, or None once
        the actor is told to stop. Raises Unavailable after reconnect_timeout_s of failures;
        ``once``: a single attempt, its failure (of any kind) returned rather than raised."""
        await self._close_link(link)
        deadline = time.monotonic() + self.reconnect_timeout_s
        delay = 0.1
        while True:
            session = EnvSession(link.address, request_timeout_s=self.request_timeout_s)
            try:
                info = await session.create(
                    self.env_id,
                    link.num_envs,
                    seed=link.seed if seeded else None,  # a new session after a fault: OS seeds
                    kwargs=self.env_kwargs,
                )
                self._check_spaces(link, info)
                await self._colocate(link, session)
                obs, _ = await session.reset()
                link.session, link.info = session, info
                self._count_transports()
                return np.asarray(obs)
            except Exception as exc:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(session.close(), 5.0)
                if once:  # the caller sets this server aside, whatever went wrong there
                    return exc
                if not is_transient(exc):
                    raise
                left = deadline - time.monotonic()
                if left <= 0:
                    raise Unavailable(
                        f"env server {link.address}: no session after "
                        f"{self.reconnect_timeout_s:g}s of retries; last error: {exc}"
                    ) from exc
                log.info("env server %s: %s; retrying in %.1fs", link.address, exc, delay)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stop_event.wait(), min(delay, left))
            if self.stop_event.is_set():
                return None
            delay = min(delay * 2, 5.0)

    async def _colocate(self, link: Link, session: EnvSession) -> None:
        waits = {"busy_poll_us": self.colocated_busy_poll_us, "block_us": self.colocated_block_us}
        if self.colocated == "auto" and not await session.colocate(**waits):
            log.info("env server %s: gRPC steps (%s)", link.address, session.colocate_reason)
        link.transport = session.transport

    def _check_spaces(self, link: Link, info: SessionInfo) -> None:
        from gymnasium import spaces

        if self.observation_space is None:
            if not isinstance(info.observation_space, spaces.Box):
                raise InvalidArgument(
                    f"{self.env_id}: game actors need a Box observation space, "
                    f"got {info.observation_space}",
                    field="env_id",
                )
            self.observation_space, self.action_space = info.observation_space, info.action_space
        elif (info.observation_space, info.action_space) != (
            self.observation_space,
            self.action_space,
        ):
            raise InvalidArgument(
                f"env server {link.address}: {self.env_id} has spaces {info.observation_space}, "
                f"{info.action_space}; another server gave {self.observation_space}, "
                f"{self.action_space}",
                field="env_servers",
            )

    async def _close_link(self, link: Link) -> None:
        session, link.session = link.session, None
        if link.transport:
            link.transport = ""
            self._count_transports()
        if session is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(session.close(), 5.0)

    async def close(self) -> None:
        """Close every session (CloseRequest where the stream still works)."""
        await asyncio.gather(*(self._close_link(link) for link in self.links))


async def _step(link: Link, actions: np.ndarray) -> StepResult | Exception:
    """One link's step; an error is returned, not raised, so the others' results survive."""
    try:
        return await link.session.step(actions[link.start : link.stop])  # type: ignore[union-attr]
    except Exception as exc:
        return exc


def _restart_rows(link: Link, first: np.ndarray, out: StepOut, events: TickEvents) -> None:
    """The link's columns move to its new session: an episode this tick did not end is
    truncated at the observation the tick produced (already done for a dropped server's
    columns, and for episodes the env itself ended), then the session's reset observations
    are what the policy sees next."""
    rows = slice(link.start, link.stop)
    going = ~(out.terminated[rows] | out.truncated[rows])
    if going.any():
        cut = np.flatnonzero(going)
        events.final_indices.append(cut + link.start)
        events.final_obs.append(np.array(out.next_obs[rows][cut]))
        out.truncated[rows] = out.truncated[rows] | going
    out.next_obs[rows] = first


def _write(link: Link, result: StepResult, out: StepOut, events: TickEvents) -> None:
    """Copy one server's answer into the rows of its envs."""
    rows = slice(link.start, link.stop)
    out.next_obs[rows] = result.observations
    out.rewards[rows] = result.rewards
    out.terminated[rows] = result.terminated
    out.truncated[rows] = result.truncated
    if result.final_observations is not None:  # some env ended; truncations need finals
        cut = np.flatnonzero(result.truncated & ~result.terminated)
        if cut.size:
            events.final_indices.append(cut + link.start)
            events.final_obs.append(np.array(result.final_observations[cut]))
    if result.episodes:
        base = link.start
        events.episodes.extend(
            (base + e.env_index, e.episode_return, e.length, e.truncated, e.score)
            for e in result.episodes
        )
