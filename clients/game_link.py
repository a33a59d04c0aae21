"""The Python SDK of GameLinkService: a game that owns its loop asks the run for actions.

    link = GameLink(game="my-game", env_id="MyGame-v0", observation_space=obs_space,
                    action_space=act_space, num_agents=4)   # address: $RLFLEET_GAME_LINK_ADDRESS
    while running:
        actions = link.act(observations, rewards, terminated, truncated, episode_ids)
        ...apply actions, advance the game one tick...
    farewell = link.close("game closed")                     # Goodbye -> Farewell(ticks, episodes)

`act` is lock step (one observation in flight). A game that can apply actions late pipelines
with `submit(tick, ...)` and `receive() -> (tick, actions, policy_version)`, up to
`max_in_flight` (as granted by the server) submitted and not yet received. Per-tick arrays have a
leading dimension N = num_agents: observations shaped like the observation space, rewards float32,
terminated/truncated bool, episode_ids int64 (a new id per agent and episode; the server refuses
only the ended id in the row right after its end, but a resume tells a continuing episode by its
id, so keep ids unique within a link: a game that restarts with the same session key should not
restart its counter at 0).

Reconnects are automatic: when the stream breaks (UNAVAILABLE, a transport error) the link
reconnects with its session key (a fresh UUID unless given) for up to the server's
resume_window_s, the server resumes the link (`resumed`, `last_tick`) and the observations that
were not answered are sent again. A reply the server sent but the break swallowed (its tick <=
last_tick) cannot be fetched again: its actions are made up locally (a sample of the action
space; the server recorded its own, so one transition per such break is off-policy; breaks are
rare and the window is one reply long). A takeover (another process said Hello with this key)
ends the link with an Aborted error. In-band errors (a bad shape, a NaN reward, ...) raise
services.errors.InvalidArgument & co. naming the field; the link stays usable.

`AsyncGameLink` is the same for asyncio games: each call runs the blocking one in a worker
thread (one at a time), so the event loop keeps running while a reply is awaited.

Only gRPC, numpy, the generated stubs and common/ are imported: a game does not load the server.
docs/game_link.md walks through the protocol; the TypeScript and C++ SDKs use the same names.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import queue
import time
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np

from common import spaces, tensor
from rlfleet.env.v1 import game_link_pb2, game_link_pb2_grpc
from services.errors import (
    FailedPrecondition,
    RlfleetError,
    Unavailable,
    from_rpc_error,
    from_status,
)

__all__ = ["ADDRESS_ENV", "PROTOCOL_VERSION", "RUN_ENV", "AsyncGameLink", "Farewell", "GameLink"]

log = logging.getLogger(__name__)

ADDRESS_ENV = "RLFLEET_GAME_LINK_ADDRESS"  # host:port of the env server, set by the launcher
RUN_ENV = "RLFLEET_RUN"
PROTOCOL_VERSION = 1
_RETRIED = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}


@dataclass(frozen=True)
class Farewell:
    """What the link did, as the server counted it."""

    ticks: int  # observation batches answered, resumes included
    episodes: int  # episodes ended by the game's terminated/truncated flags


class _Call:
    """One Connect stream: requests go in through a queue, responses come out in order."""

    def __init__(self, stub: game_link_pb2_grpc.GameLinkServiceStub) -> None:
        self._requests: queue.Queue[game_link_pb2.ConnectRequest | None] = queue.Queue()
        self._call = stub.Connect(self._iterate())

    def _iterate(self) -> Iterator[game_link_pb2.ConnectRequest]:
        while (item := self._requests.get()) is not None:
            yield item

    def send(self, request: game_link_pb2.ConnectRequest) -> None:
        self._requests.put(request)

    def receive(self) -> game_link_pb2.ConnectResponse:
        return next(self._call)  # type: ignore[no-any-return]

    def close(self) -> None:
        self._requests.put(None)
        self._call.cancel()


class GameLink:
    """One game instance's link to a run; see the module docstring."""

    def __init__(
        self,
        address: str | None = None,
        *,
        game: str,
        env_id: str,
        observation_space: Any,
        action_space: Any,
        num_agents: int,
        session_key: str | None = None,
        max_in_flight: int = 1,
        labels: Mapping[str, str] | None = None,
        connect_timeout_s: float = 60.0,
    ) -> None:
        address = address or os.environ.get(ADDRESS_ENV, "")
        if not address:
            raise FailedPrecondition(
                f"GameLink: no address given and ${ADDRESS_ENV} is not set (host:port of the "
                "env server)"
            )
        self.address = address
        self.num_agents = num_agents
        self.observation_space, self.action_space = observation_space, action_space
        self.session_key = uuid.uuid4().hex if session_key is None else session_key
        self._hello = game_link_pb2.Hello(
            game=game,
            env_id=env_id,
            observation_space=spaces.to_proto(observation_space),
            action_space=spaces.to_proto(action_space),
            num_agents=num_agents,
            protocol_version=PROTOCOL_VERSION,
            session_key=self.session_key,
            max_in_flight=max_in_flight,
            labels=dict(labels or {}),
        )
        self._channel = grpc.insecure_channel(address)
        self._stub = game_link_pb2_grpc.GameLinkServiceStub(self._channel)
        self._call: _Call | None = None
        self._request_ids = iter(range(1, 1 << 62))
        # Submitted, not yet received: (request_id, tick, request).
        self._pending: collections.deque[tuple[int, int, Any]] = collections.deque()
        self._made_up: collections.deque[tuple[int, np.ndarray]] = collections.deque()
        self.last_tick = 0  # the last tick submitted
        self.link_id = ""
        self.resumed = False
        self.max_in_flight = 1
        self.resume_window_s = 0.0
        self.run = ""
        self.policy_version = 0
        self.reconnects = 0
        self._connect(time.monotonic() + connect_timeout_s)

    # ------------------------------------------------------------------ the tick API

    def act(
        self,
        observations: Any,
        rewards: Any,
        terminated: Any,
        truncated: Any,
        episode_ids: Any,
        *,
        scores: Any = None,
    ) -> np.ndarray:
        """Lock step: send this tick's observations, wait for the agents' actions. `scores`:
        see `submit`."""
        if self._pending:
            raise FailedPrecondition("act() with submitted ticks not received: receive() first")
        self.submit(
            self.last_tick + 1,
            observations,
            rewards,
            terminated,
            truncated,
            episode_ids,
            scores=scores,
        )
        return self.receive()[1]

    def submit(
        self,
        tick: int,
        observations: Any,
        rewards: Any,
        terminated: Any,
        truncated: Any,
        episode_ids: Any,
        *,
        scores: Any = None,
    ) -> None:
        """Send one tick without waiting; at most `max_in_flight` may be unanswered.

        `scores`: the game's score of each agent (NaN: none), read by the server for the agents
        whose episode ends at this tick (their EpisodeStats.score, charts/episodic_score)."""
        if len(self._pending) >= self.max_in_flight:
            raise FailedPrecondition(
                f"{len(self._pending)} ticks in flight, the granted max_in_flight: receive() first"
            )
        n = self.num_agents
        batch = game_link_pb2.ObservationBatch(
            tick=tick,
            observations=tensor.encode_tree(np.asarray(observations)),
            rewards=tensor.encode(_column(rewards, np.float32, n)),
            terminated=tensor.encode(_column(terminated, np.bool_, n)),
            truncated=tensor.encode(_column(truncated, np.bool_, n)),
            episode_ids=tensor.encode(_column(episode_ids, np.int64, n)),
        )
        if scores is not None:  # infos["score"] with its mask, as the protocol reads it
            column = _column(scores, np.float64, n)
            infos = {"score": np.nan_to_num(column), "_score": np.isfinite(column)}
            batch.infos.CopyFrom(tensor.encode_tree(infos))
        request_id = next(self._request_ids)
        request = game_link_pb2.ConnectRequest(request_id=request_id, observations=batch)
        self._pending.append((request_id, tick, request))
        self.last_tick = max(self.last_tick, tick)
        self._send(request)

    def receive(self) -> tuple[int, np.ndarray, int]:
        """(tick, actions [N, ...], policy_version) of the oldest submitted tick."""
        if self._made_up:  # (all older than what is pending: the server answers in order)
            tick, actions = self._made_up.popleft()
            return tick, actions, self.policy_version
        if not self._pending:
            raise FailedPrecondition("receive() with nothing submitted")
        response = self._receive()
        _, tick, _ = self._pending.popleft()
        if response.HasField("error"):
            raise from_status(response.error)
        reply = response.actions
        self.policy_version = int(reply.policy_version)
        actions = tensor.decode_tree(reply.actions, name="actions")
        return tick, np.array(actions), self.policy_version

    def close(self, reason: str = "") -> Farewell:
        """Goodbye: the server answers what is in flight (dropped here), then Farewell."""
        while self._pending or self._made_up:
            self.receive()
        request = game_link_pb2.ConnectRequest(
            request_id=next(self._request_ids), goodbye=game_link_pb2.Goodbye(reason=reason)
        )
        self._send(request)
        response = self._receive(reconnect=False)
        if response.HasField("error"):
            raise from_status(response.error)
        self._shutdown()
        return Farewell(int(response.farewell.ticks), int(response.farewell.episodes))

    def __enter__(self) -> GameLink:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._call is not None:
            try:
                self.close("game closed")
            except RlfleetError:
                self._shutdown()

    def _shutdown(self) -> None:
        if self._call is not None:
            self._call.close()
            self._call = None
        self._channel.close()

    # ------------------------------------------------------------------ the stream

    def _send(self, request: game_link_pb2.ConnectRequest) -> None:
        assert self._call is not None
        self._call.send(request)

    def _receive(self, *, reconnect: bool = True) -> game_link_pb2.ConnectResponse:
        while True:
            assert self._call is not None
            try:
                return self._call.receive()
            except StopIteration:
                error: RlfleetError = Unavailable("the server ended the stream")
            except grpc.RpcError as exc:
                error = from_rpc_error(exc)
                if error.code not in _RETRIED:
                    raise error from None
            if not reconnect:
                raise error
            log.warning("game link %s: stream broke (%s): reconnecting", self.link_id, error)
            self.reconnects += 1
            self._connect(time.monotonic() + max(self.resume_window_s, 5.0))

    def _connect(self, deadline: float) -> None:
        """Open a stream and say Hello (again), retrying while the server is unreachable;
        then send the pending observations again (see the module docstring)."""
        while True:
            if self._call is not None:
                self._call.close()
            self._call = _Call(self._stub)
            self._send(
                game_link_pb2.ConnectRequest(request_id=next(self._request_ids), hello=self._hello)
            )
            try:
                response = self._call.receive()
                break
            except (grpc.RpcError, StopIteration) as exc:
                error = from_rpc_error(exc) if isinstance(exc, grpc.RpcError) else None
                if error is not None and error.code not in _RETRIED:
                    raise error from None
                if time.monotonic() > deadline:
                    raise Unavailable(f"game link to {self.address}: no answer: {exc}") from None
                time.sleep(0.2)
        if response.HasField("error"):
            raise from_status(response.error)
        welcome = response.welcome
        self.link_id, self.resumed = welcome.link_id, welcome.resumed
        self.max_in_flight = int(welcome.max_in_flight)
        self.resume_window_s, self.run = welcome.resume_window_s, welcome.run
        self.policy_version = int(welcome.policy_version)
        server_last = int(welcome.last_tick) if welcome.resumed else 0
        self.last_tick = max(self.last_tick, server_last)  # act() continues after it
        self._resend(server_last)

    def _resend(self, server_last: int) -> None:
        pending, self._pending = list(self._pending), collections.deque()
        for request_id, tick, request in pending:
            if tick > server_last:
                self._pending.append((request_id, tick, request))
                self._send(request)
            else:  # answered before the break, the reply lost: make the actions up
                log.warning("game link %s: reply to tick %d lost in a break", self.link_id, tick)
                self._made_up.append((tick, self._throwaway()))

    def _throwaway(self) -> np.ndarray:
        sample = np.asarray(self.action_space.sample())
        return np.repeat(sample[None], self.num_agents, axis=0)


class AsyncGameLink:
    """GameLink for asyncio: `link = await AsyncGameLink.open(...)`, then `await link.act(...)`."""

    def __init__(self, link: GameLink) -> None:
        self.link = link
        self._lock = asyncio.Lock()

    @classmethod
    async def open(cls, address: str | None = None, **kwargs: Any) -> AsyncGameLink:
        """Connect and say Hello (GameLink's arguments)."""
        return cls(await asyncio.to_thread(GameLink, address, **kwargs))

    async def _call(self, method: Any, *args: Any, **kwargs: Any) -> Any:
        async with self._lock:
            return await asyncio.to_thread(method, *args, **kwargs)

    async def act(self, *arrays: Any, scores: Any = None) -> np.ndarray:
        """GameLink.act(observations, rewards, terminated, truncated, episode_ids, scores=)."""
        return await self._call(self.link.act, *arrays, scores=scores)  # type: ignore[no-any-return]

    async def submit(self, tick: int, *arrays: Any, scores: Any = None) -> None:
        await self._call(self.link.submit, tick, *arrays, scores=scores)

    async def receive(self) -> tuple[int, np.ndarray, int]:
        return await self._call(self.link.receive)  # type: ignore[no-any-return]

    async def close(self, reason: str = "") -> Farewell:
        return await self._call(self.link.close, reason)  # type: ignore[no-any-return]


def _column(values: Any, dtype: Any, n: int) -> np.ndarray:
    array = np.asarray(values, dtype=dtype)
    return np.broadcast_to(array, (n,)) if array.ndim == 0 else array
