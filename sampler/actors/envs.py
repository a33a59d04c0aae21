"""An actor's environments: one EnvService session per env server, stepped as one batch.

The actor's N envs are split over its servers in order (server j holds envs [start_j, stop_j)).
Each tick sends every server its slice of the actions concurrently and writes the answers
straight into the caller's preallocated rows, so nothing per env runs in Python.

Double-buffered (sampler/actors/sampling.py), each server's share is split over two sessions
and the envs form two parts: part 0 is every server's first session, part 1 every second one,
so each part is a contiguous range of env columns. `step(..., part=p)` steps one part's
sessions, leaving the other part free to be inferred on meanwhile.

A server that drops its stream (restart, network fault, request timeout) must not end the run:
its envs' step at that tick is recorded as truncated at the observation they were in (reward 0,
bootstrapped from that observation), and the session is recreated with backoff; its envs start
new episodes. Errors that are the request's fault (bad action, unknown env id) are raised.

A server on this host is offered the co-located fast path (docs/colocated.md) at every session
(re)creation unless `colocated="off"`; each link's transport is in its `transport`, in the
`rlfleet_actor_env_links{actor, transport}` gauge and in the actor's log lines.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np

from clients.env import EnvSession, SessionInfo, StepResult
from services.errors import InvalidArgument, RlfleetError, Unavailable, code_of
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
    """N envs of one env id over several servers, SAME_STEP autoreset, Box observations."""

    def __init__(
        self,
        addresses: list[str],
        split: list[int],
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
        self.env_id = env_id
        self.colocated = colocated  # "auto" or "off"
        self.colocated_busy_poll_us = colocated_busy_poll_us
        # Blocking waits only for a lone session: steps of several are awaited together.
        lone = len(addresses) == 1 and not double_buffer
        self.colocated_block_us = colocated_block_us if lone else 0
        self.name = name  # the actor's, for the metric
        self.env_kwargs = dict(env_kwargs or {})
        self.request_timeout_s = request_timeout_s
        self.reconnect_timeout_s = reconnect_timeout_s
        self.stop_event = stop_event or asyncio.Event()
        self.links: list[Link] = []
        self.parts: list[slice] = []  # env columns of each part
        self.part_links: list[list[Link]] = []
        # One part of whole shares, or two: each server's first ceil(c/2) envs, then the rest.
        shares = [list(zip(addresses, split, strict=True))]
        if double_buffer:
            if min(split) < 2:
                raise InvalidArgument(
                    "double buffering needs at least 2 envs on every env server", field="num_envs"
                )
            shares = [[(a, c - c // 2) for a, c in shares[0]], [(a, c // 2) for a, c in shares[0]]]
        start = 0
        for part in shares:
            first = start
            self.part_links.append([])
            for address, count in part:
                link_seed = None if seed is None else seed + start
                link = Link(address, start, start + count, link_seed)
                self.links.append(link)
                self.part_links[-1].append(link)
                start += count
            self.parts.append(slice(first, start))
        self.num_envs = start
        self.observation_space: Any = None
        self.action_space: Any = None

    @property
    def addresses(self) -> str:
        return ",".join(link.address for link in self.links)

    @property
    def transports(self) -> str:
        """Each link's transport, in env_servers order (for logs)."""
        return ",".join(link.transport or "-" for link in self.links)

    def _count_transports(self) -> None:
        for transport in TRANSPORTS:
            count = sum(link.transport == transport for link in self.links)
            _LINKS.labels(self.name, transport).set(count)

    @property
    def session_ids(self) -> str:
        return ",".join(link.info.session_id if link.info else "" for link in self.links)

    async def open(self) -> np.ndarray | None:
        """Create and reset every session (retrying transient failures): the first observations
        of all N envs, or None when told to stop meanwhile."""
        firsts = await asyncio.gather(*(self._connect(link, seeded=True) for link in self.links))
        if any(first is None for first in firsts):
            return None
        obs = np.empty((self.num_envs, *self.observation_space.shape), self.observation_space.dtype)
        for link, first in zip(self.links, firsts, strict=True):
            obs[link.start : link.stop] = first
        return obs

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
        for link, result in zip(links, results, strict=True):
            if isinstance(result, BaseException):
                link.failures += 1
                if not is_transient(result) or link.failures > MAX_CONSECUTIVE_DROPS:
                    raise result
                await self._drop(link, result, obs, out, events)
            else:
                if link.failures:
                    link.failures = 0
                _write(link, result, out, events)
        return events

    async def _drop(
        self,
        link: Link,
        exc: BaseException,
        obs: np.ndarray,
        out: StepOut,
        events: TickEvents,
    ) -> None:
        """Record the link's envs as truncated where they stood, then recreate its session."""
        rows = slice(link.start, link.stop)
        log.warning("env server %s: %s; recreating the session", link.address, exc)
        out.rewards[rows] = 0.0
        out.terminated[rows] = False
        out.truncated[rows] = True
        events.final_indices.append(np.arange(link.start, link.stop))
        events.final_obs.append(np.array(obs[rows]))
        events.dropped.append(link.address)
        link.reconnects += 1
        first = await self._connect(link, seeded=False)
        if first is not None:
            out.next_obs[rows] = first

    async def _connect(self, link: Link, *, seeded: bool) -> np.ndarray | None:
        """(Re)create the link's session with backoff; its reset observations, or None once
        the actor is told to stop. Raises Unavailable after reconnect_timeout_s of failures."""
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
