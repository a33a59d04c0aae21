"""`EnvSession` (async, one Session stream), `SyncEnvSession` (the same, blocking),
`env_spaces` and `list_envs`."""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections.abc import AsyncIterator, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
import gymnasium
import numpy as np
from google.protobuf import struct_pb2
from google.rpc import status_pb2
from gymnasium.vector import AutoresetMode

from clients.env.colocated import ClientRing
from clients.env.shm_ring import Unsupported, host_id, layout_for
from clients.env.types import EnvEntry, EpisodeStats, StepResult
from common import spaces, tensor
from rlfleet.env.v1 import env_pb2, env_pb2_grpc
from services.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    RlfleetError,
    Unavailable,
    from_rpc_error,
    from_status,
)
from services.grpc_names import service_name
from services.server import channel

T = TypeVar("T")
SERVICE_NAME = service_name(env_pb2, "EnvService")  # for health checks

_MODE_TO_PROTO = {
    AutoresetMode.SAME_STEP: env_pb2.AUTORESET_MODE_SAME_STEP,
    AutoresetMode.NEXT_STEP: env_pb2.AUTORESET_MODE_NEXT_STEP,
    AutoresetMode.DISABLED: env_pb2.AUTORESET_MODE_DISABLED,
}
_MODE_FROM_PROTO = {v: k for k, v in _MODE_TO_PROTO.items()}


# The errors gymnasium users catch, as rlfleet errors: each is both the services.errors class the
# server sent (so `except InvalidArgument` keeps working) and the gymnasium/builtin exception a
# local env raises in the same situation.
class InvalidActionError(InvalidArgument, gymnasium.error.InvalidAction, ValueError):
    """A step's actions were rejected (shape, dtype, range, NaN); no environment was stepped."""


class ResetNeededError(FailedPrecondition, gymnasium.error.ResetNeeded):
    """Step before reset, or (DISABLED mode) stepping an env whose episode ended."""


class ClosedEnvError(FailedPrecondition, gymnasium.error.ClosedEnvironmentError):
    """A request on a session that is closed (or was aborted)."""


class UnknownEnvError(NotFound, gymnasium.error.NameNotFound):
    """The server has no env of that id (gymnasium.make raises NameNotFound locally)."""


class InvalidSeedError(InvalidArgument, gymnasium.error.Error):
    """A negative or non-integer seed (gymnasium's seeding raises its Error locally)."""


class RemoteAttributeError(RlfleetError, AttributeError):
    """An attribute or method of the remote envs that cannot be reached over the wire."""

    code = grpc.StatusCode.UNIMPLEMENTED


def _as_gym_error(error: RlfleetError, kind: str) -> RlfleetError:
    """The server's error for a request of `kind`, as the gymnasium-catchable subclass."""
    cls: type[RlfleetError] | None = None
    if kind == "step" and type(error) is InvalidArgument:
        # The actions' fault; not the env's own NaN observations ("step.observations").
        if not (error.field or "").startswith("step."):
            cls = InvalidActionError
    elif kind == "create" and type(error) is NotFound:
        cls = UnknownEnvError
    elif kind in ("step", "reset") and type(error) is FailedPrecondition:
        cls = ResetNeededError
    if cls is None:
        return error
    out = cls(error.message, field=error.field)
    out.request_id = error.request_id
    if out.code != error.code:
        out.code = error.code
    return out


@dataclass(frozen=True)
class SessionInfo:
    """What CreateRequest answered: the pool's shape and spaces (of ONE env)."""

    session_id: str
    env: EnvEntry
    num_envs: int
    observation_space: gymnasium.Space
    action_space: gymnasium.Space
    autoreset_mode: AutoresetMode
    render_modes: tuple[str, ...] = ()  # the env's render modes a session may be created with
    render_fps: float | None = None  # the env's metadata["render_fps"], when it declares one


class EnvSession:
    """One `EnvService.Session` stream: create, then reset/step/render, then close.

    Requests go one at a time (the protocol answers in order; a policy needs the observation
    before the next action anyway). Each waits at most `request_timeout_s` for its answer: a
    stream has no overall deadline, every request does.
    """

    def __init__(
        self,
        address: str,
        *,
        request_timeout_s: float = 120.0,
        max_message_bytes: int = 64 << 20,
    ) -> None:
        self.address = address
        self.request_timeout_s = request_timeout_s
        self._channel = channel(address, max_message_bytes=max_message_bytes)
        self._call: Any = None
        # Requests reach grpc through an iterator rather than call.write(): with the client
        # interceptors channel() installs, each write() costs a task, a queue hand-off and an
        # asyncio.wait; a fed iterator shortens a small step's round trip (at many envs
        # stepping dominates either way).
        self._outbox: asyncio.Queue[env_pb2.SessionRequest | None] = asyncio.Queue()
        self._ids = itertools.count(1)
        self._busy = False
        self._ended: RlfleetError | None = None  # why the stream is over, once it is
        self.info: SessionInfo | None = None
        self._float64_rewards = False
        # The co-located fast path (docs/colocated.md), once the server accepted it.
        self._ring: ClientRing | None = None
        self.colocate_reason = ""  # why the last offer was declined, for logs

    @property
    def transport(self) -> str:
        """How steps travel: "shm" (a co-located ring) or "grpc" (StepRequest messages)."""
        return "shm" if self._ring is not None else "grpc"

    async def __aenter__(self) -> EnvSession:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def _request(self, **kind: Any) -> env_pb2.SessionResponse:
        if self._busy:  # answers come in order: two tasks would take each other's answers
            raise RuntimeError("EnvSession: one request at a time (another task is waiting)")
        if self._ended is not None:
            raise self._ended
        request = env_pb2.SessionRequest(request_id=next(self._ids), **kind)
        if self._call is None:
            self._call = env_pb2_grpc.EnvServiceStub(self._channel).Session(self._requests())
        self._busy = True
        try:
            self._outbox.put_nowait(request)
            async with asyncio.timeout(self.request_timeout_s):
                response = await self._call.read()
        except grpc.RpcError as exc:
            raise self._end(from_rpc_error(exc)) from None
        except TimeoutError:
            self.abort()
            raise self._end(
                Unavailable(
                    f"{self.address}: no answer to request {request.request_id} within "
                    f"{self.request_timeout_s:g}s; session aborted"
                )
            ) from None
        finally:
            self._busy = False
        if response is grpc.aio.EOF:
            raise self._end(await self._status_error())
        if response.HasField("error"):
            raise _as_gym_error(from_status(response.error), request.WhichOneof("request"))
        return response

    async def _requests(self) -> AsyncIterator[env_pb2.SessionRequest]:
        """The stream's requests, as `_request` posts them; None half-closes the stream."""
        while (request := await self._outbox.get()) is not None:
            yield request

    async def _status_error(self) -> RlfleetError:
        """The error for a stream the server has ended: its status, as an RlfleetError."""
        code = await self._call.code()
        if code == grpc.StatusCode.OK:
            return Unavailable(f"{self.address}: the server ended the session stream")
        status = status_pb2.Status(code=code.value[0], message=await self._call.details() or "")
        return from_status(status)

    def _end(self, error: RlfleetError) -> RlfleetError:
        """Remember that the stream is over: a session is one stream, later requests fail too."""
        self._ended = error
        return error

    async def create(
        self,
        env_id: str,
        num_envs: int = 1,
        *,
        seed: int | None = None,
        kwargs: dict[str, Any] | None = None,
        autoreset_mode: AutoresetMode | str = AutoresetMode.SAME_STEP,
        render_mode: str | None = None,
        float64_rewards: bool = False,
    ) -> SessionInfo:
        """Create the pool: env i is seeded with seed + i at the first reset.

        Rewards come as float32 unless `float64_rewards` (the envs' values, unrounded).
        """
        request = env_pb2.CreateRequest(
            env_id=env_id,
            num_envs=num_envs,
            seed=seed,
            autoreset_mode=_MODE_TO_PROTO[AutoresetMode(autoreset_mode)],
            render_mode=render_mode or "",
            float64_rewards=float64_rewards,
        )
        if kwargs:
            request.kwargs.update(kwargs)
        self._float64_rewards = float64_rewards
        msg = (await self._request(create=request)).create
        self.info = SessionInfo(
            session_id=msg.session_id,
            env=EnvEntry.from_proto(msg.env),
            num_envs=msg.num_envs,
            observation_space=spaces.from_proto(msg.observation_space, name="observation_space"),
            action_space=spaces.from_proto(msg.action_space, name="action_space"),
            autoreset_mode=_MODE_FROM_PROTO[msg.autoreset_mode],
            render_modes=tuple(msg.render_modes),
            render_fps=msg.render_fps if msg.HasField("render_fps") else None,
        )
        return self.info

    async def colocate(self, slots: int = 2, busy_poll_us: int = 0, block_us: int = 0) -> bool:
        """Offer the server a shared-memory ring for this session's steps (after create).

        True when accepted: `step` then goes through the ring and returns read-only views of
        it, valid until `slots` more steps have been taken; infos are not carried. False when
        this cannot work (another host, spaces the ring cannot hold, a server that declines or
        predates it): steps stay on gRPC and `colocate_reason` says why. Errors of the stream
        itself (the server is gone) are raised as from any request. `busy_poll_us`: poll for
        each step's answer this long before awaiting it (clients/env/shm_ring.py).
        `block_us`: then wait for it this long in the kernel, the event loop blocked, before
        awaiting it; for a caller that steps one session in lock step (the steps of several
        sessions awaited together would be taken one after the other). Either way a step
        lets the event loop run regularly (clients/env/colocated.py, _MAX_BLOCKED_S).
        """
        if self.info is None:
            raise FailedPrecondition("colocate before create: create the pool first")
        if self._ring is not None:
            return True
        if host_id() is None:
            self.colocate_reason = "no host identity here (Linux boot id)"
            return False
        try:
            layout = layout_for(
                self.info.observation_space,
                self.info.action_space,
                self.info.num_envs,
                slots,
                float64_rewards=self._float64_rewards,
            )
        except Unsupported as exc:
            self.colocate_reason = str(exc)
            return False
        ring = ClientRing.create(layout, busy_poll_us, block_us)
        try:
            answer = (await self._request(colocate=ring.offer())).colocate
            if answer.accepted:
                ring.attach()
                self._ring = ring
                self.colocate_reason = ""
                return True
            self.colocate_reason = answer.reason or "declined by the server"
            return False
        except RlfleetError as exc:
            if self._ended is not None:
                raise  # the stream is gone, not just the offer
            # An offer the server rejects (or does not know: an older server answers an empty
            # request) is no reason to fail the session: it goes on over gRPC.
            self.colocate_reason = f"{type(exc).__name__}: {exc}"
            return False
        finally:
            if self._ring is not ring:
                ring.close()

    async def reset(
        self,
        *,
        seed: int | Sequence[int | None] | None = None,
        env_indices: Sequence[int] = (),
        options: dict[str, Any] | None = None,
    ) -> tuple[Any, dict[str, Any]]:
        """Reset all envs (or `env_indices`); env i gets seed + i. Returns (obs [N...], infos).

        A sequence of seeds gives each env reset its own (the k-th env reset gets seed[k];
        None keeps its RNG), as SyncVectorEnv's reset(seed=[...]) does.
        """
        request = env_pb2.ResetRequest(env_indices=list(env_indices))
        if isinstance(seed, Sequence):
            if any(s is not None and s < 0 for s in seed):
                raise InvalidArgument(f"seeds must be >= 0 or None, got {list(seed)}", field="seed")
            request.seeds.extend(-1 if s is None else int(s) for s in seed)
        elif seed is not None:
            request.seed = int(seed)
        if options is not None:
            request.options.CopyFrom(_struct(options))
        msg = (await self._request(reset=request)).reset
        infos = tensor.decode_tree(msg.infos) if msg.HasField("infos") else {}
        return tensor.decode_tree(msg.observations, name="observations"), infos

    async def step(self, actions: Any) -> StepResult:
        """Step all N envs with `actions` (leading dimension N, the action space's dtype)."""
        if self._ring is not None:
            return await self._ring_step(actions)
        request = env_pb2.StepRequest(actions=tensor.encode_tree(actions))
        msg = (await self._request(step=request)).step
        final = msg.final_observations
        return StepResult(
            observations=tensor.decode_tree(msg.observations, name="observations"),
            rewards=tensor.decode(msg.rewards, name="rewards"),
            terminated=tensor.decode(msg.terminated, name="terminated"),
            truncated=tensor.decode(msg.truncated, name="truncated"),
            infos=tensor.decode_tree(msg.infos) if msg.HasField("infos") else {},
            final_observations=tensor.decode_tree(final)
            if msg.HasField("final_observations")
            else None,
            episodes=[
                EpisodeStats(
                    e.env_index,
                    e.episode_return,
                    e.length,
                    e.truncated,
                    e.score if e.HasField("score") else None,
                )
                for e in msg.episodes
            ],
        )

    async def _ring_step(self, actions: Any) -> StepResult:
        assert self._ring is not None
        if self._busy:
            raise RuntimeError("EnvSession: one request at a time (another task is waiting)")
        if self._ended is not None:
            raise self._ended
        self._busy = True
        try:
            return await self._ring.step(actions, self.request_timeout_s)
        except Unavailable as exc:  # the ring is gone with its server: so is the session
            self.abort()
            raise self._end(exc) from None
        except RlfleetError as exc:
            raise _as_gym_error(exc, "step") from None
        finally:
            self._busy = False

    async def render(self, env_indices: Sequence[int] = ()) -> np.ndarray:
        """RGB frames uint8 [K, H, W, 3] (default: env 0); needs render_mode='rgb_array'."""
        request = env_pb2.RenderRequest(env_indices=list(env_indices))
        return tensor.decode((await self._request(render=request)).render.frames, name="frames")

    async def close(self) -> int:
        """Close the pool and the stream; returns the session's total env steps (0 if none).

        Idempotent; the channel is closed even when the server is already gone.
        """
        call, total = self._call, 0
        self._close_ring()
        try:
            if call is not None and self._ended is None and not call.done():
                total = (await self._request(close=env_pb2.CloseRequest())).close.total_steps
                self._outbox.put_nowait(None)
        finally:
            if call is not None:
                call.cancel()  # no-op once the server has ended the stream
            self._end(ClosedEnvError("the session is closed"))
            await self._channel.close()
        return total

    def _close_ring(self) -> None:
        ring, self._ring = self._ring, None
        if ring is not None:
            ring.close()

    def abort(self) -> None:
        """Drop the stream without a CloseRequest (the server frees the pool on cancellation)."""
        self._close_ring()
        if self._call is not None:
            self._call.cancel()
        self._end(ClosedEnvError("the session was aborted"))


def _struct(value: dict[str, Any]) -> struct_pb2.Struct:
    out = struct_pb2.Struct()
    out.update(value)
    return out


_thread = threading.local()


def _thread_loop() -> asyncio.AbstractEventLoop:
    """The calling thread's event loop for sync sessions, made once and never closed.

    One loop per thread rather than one per session: grpc's poller delivers a channel's last
    completions (of a cancelled stream) to the loop the channel was made on, possibly after
    close() returned; on a closed loop that logs "RuntimeError: Event loop is closed" from a
    callback, an open one just queues them. grpc keeps every loop it has seen referenced anyway.
    """
    loop: asyncio.AbstractEventLoop | None = getattr(_thread, "loop", None)
    if loop is None or loop.is_closed():
        loop = _thread.loop = asyncio.new_event_loop()
    return loop


class SyncEnvSession:
    """Blocking EnvSession, run on the calling thread's own event loop (see `_thread_loop`).

    Not usable from inside a running event loop (use EnvSession there).
    """

    def __init__(self, address: str, **session_kwargs: Any) -> None:
        self._loop = _thread_loop()
        self._closed = False

        async def open_session() -> EnvSession:  # the channel binds to the loop it is made on
            return EnvSession(address, **session_kwargs)

        self.session = self._run(open_session())

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self._loop.run_until_complete(coro)

    def _open(self) -> EnvSession:
        """The session, checked open before a coroutine is made (none left un-awaited)."""
        if self._closed:
            raise ClosedEnvError("the session is closed")
        return self.session

    @property
    def info(self) -> SessionInfo | None:
        return self.session.info

    def create(self, env_id: str, num_envs: int = 1, **kwargs: Any) -> SessionInfo:
        return self._run(self._open().create(env_id, num_envs, **kwargs))

    def colocate(self, **kwargs: Any) -> bool:
        """`EnvSession.colocate`: True when steps now go through a shared-memory ring."""
        return self._run(self._open().colocate(**kwargs))

    def reset(self, **kwargs: Any) -> tuple[Any, dict[str, Any]]:
        return self._run(self._open().reset(**kwargs))

    def step(self, actions: Any) -> StepResult:
        return self._run(self._open().step(actions))

    def render(self, env_indices: Sequence[int] = ()) -> np.ndarray:
        return self._run(self._open().render(env_indices))

    def close(self) -> int:
        """Close the session (and its channel); idempotent, and prints nothing."""
        if self._closed:
            return 0
        self._closed = True
        return self._run(self.session.close())

    def __enter__(self) -> SyncEnvSession:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


async def env_spaces(
    address: str, env_id: str, kwargs: dict[str, Any] | None = None, *, timeout_s: float = 30.0
) -> tuple[gymnasium.Space, gymnasium.Space]:
    """The observation and action spaces of one ``env_id`` env on the server at ``address``.

    A server tells spaces only when a pool is created, so this creates a session of one env and
    closes it at once. Raises the server's error: ``NotFound`` for an unknown id, ``Unavailable``
    when it cannot answer yet (not up, or a game-link env id no game has linked).
    """
    async with EnvSession(address, request_timeout_s=timeout_s) as session:
        info = await session.create(env_id, 1, kwargs=kwargs)
    return info.observation_space, info.action_space


async def list_envs(address: str, filter: str = "", *, timeout_s: float = 10.0) -> list[EnvEntry]:
    """The environments the server at `address` can create."""
    async with channel(address) as ch:
        try:
            reply = await env_pb2_grpc.EnvServiceStub(ch).ListEnvs(
                env_pb2.ListEnvsRequest(filter=filter), timeout=timeout_s
            )
        except grpc.RpcError as exc:
            raise from_rpc_error(exc) from None
    return [EnvEntry.from_proto(e) for e in reply.envs]
