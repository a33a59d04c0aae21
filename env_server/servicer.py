"""`rlfleet.env.v1.EnvService`: one environment pool per Session stream.

Every request gets exactly one response, in order. A request that fails gets its error in-band
(`SessionResponse.error`, from services.errors.to_status) and the stream keeps serving; only the
server shutting down, or a session left idle for `session_idle_timeout_s`, ends a stream with a
status (UNAVAILABLE: open a new session). The pool is closed, and its session slot freed,
whenever the stream ends: CloseRequest, the client half-closing, the idle timeout, or the client
vanishing (grpc cancels the handler, which runs the `finally`).

Inputs are bounded before any work is done: env indices (at most N, each once, in range), seeds
(>= 0), the autoreset and render modes (known values), Struct kwargs/options (finite numbers),
and render output (frames must fit the server's message limit).

What the envs return is checked too: a NaN/inf observation (or final observation) fails its
reset or step in-band, INVALID_ARGUMENT naming the field and the env (its row), and the pool
must be reset before the next step, as after an env raising; `nonfinite_observations: clip`
replaces such values instead (common.spaces.finite_observations). In-band rather than ending
the session: the other envs' state and the stream survive, as the protocol wants for any one
request's fault.

Stepping runs on the event loop thread, not in `asyncio.to_thread`: a step such as CartPole's is
pure Python holding the GIL, so a thread adds a hand-off per message and buys
no parallelism; other sessions wait at most one message's stepping either way. Creating and
closing pools, which can take seconds (pygame, sprites), do go to a thread. So do the steps of a
co-located ring, on the server's ring thread, which sleeps on the rings' doorbells (env_server/
colocated.py says why); a session's pool lock keeps them and the stream's requests apart.

A session on a text env id holds a `TextPool` instead (docs/text_envs.md): chat messages in and
out, reset by the client only, each env's reset and step in a thread of its own under the
server's text_step_timeout_s, so a slow or hung env never holds the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import math
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import Any, TypeVar

import grpc
import numpy as np
from google.protobuf import struct_pb2

from clients.env.text import info_struct, message_from_proto, turn_to_proto
from clients.env.types import EnvEntry, EpisodeStats, StepResult
from common import spaces, tensor
from env_server import registry
from env_server.colocated import Declined, RingServer, ServerRing
from env_server.pool import EnvPool
from env_server.text.pool import TextPool
from rlfleet.env.v1 import env_pb2, env_pb2_grpc
from services.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    RlfleetError,
    Unavailable,
    abort_with,
    to_status,
)
from services.telemetry import metrics

__all__ = ["EnvService"]

log = logging.getLogger(__name__)
PoolT = TypeVar("PoolT", EnvPool, TextPool)

_ACTIVE_SESSIONS = metrics.gauge(
    "env_sessions_active", "EnvService.Session streams that hold a pool.", ("server",)
)
_ENV_STEPS = metrics.counter("env_steps_total", "Environment steps taken.", ("server",))
_COLOCATED = metrics.gauge(
    "env_sessions_colocated",
    "EnvService sessions stepping through a co-located shared-memory ring (docs/colocated.md).",
    ("server",),
)
_COLOCATE_OFFERS = metrics.counter(
    "env_colocate_offers_total",
    "ColocateRequests by outcome: accepted, declined (not possible here), rejected (bad offer).",
    ("server", "outcome"),
)
_MODES = {
    env_pb2.AUTORESET_MODE_UNSPECIFIED: "SAME_STEP",
    env_pb2.AUTORESET_MODE_SAME_STEP: "SAME_STEP",
    env_pb2.AUTORESET_MODE_NEXT_STEP: "NEXT_STEP",
    env_pb2.AUTORESET_MODE_DISABLED: "DISABLED",
}
# What a pool may be created with: render frames to arrays, or nothing (no windows on a server).
_RENDER_MODES = ("", "rgb_array")
# Room in a RenderResponse for everything but the frame bytes (request id, dtype, shape).
_RENDER_ENVELOPE_BYTES = 64 << 10
# And back, for the CreateResponse: the mode the session runs in (never UNSPECIFIED).
_PROTO_MODES = {
    "SAME_STEP": env_pb2.AUTORESET_MODE_SAME_STEP,
    "NEXT_STEP": env_pb2.AUTORESET_MODE_NEXT_STEP,
    "DISABLED": env_pb2.AUTORESET_MODE_DISABLED,
}


class EnvService(env_pb2_grpc.EnvServiceServicer):
    """Serves ListEnvs and Session streams within per-server and per-session limits."""

    # Who may call, by certificate kind (services/security.py; the launcher may call all):
    # actors step environments, learners read their spaces (and evaluate), env servers chain.
    CALLERS = dict.fromkeys(
        ("ListEnvs", "Session"), frozenset({"game_actor", "learner", "env_server"})
    )

    def __init__(
        self,
        *,
        name: str = "env_server",
        max_sessions: int = 64,
        max_envs_per_session: int = 1024,
        max_message_bytes: int = 64 << 20,
        session_idle_timeout_s: float = 600.0,
        linked_spaces: Callable[[str], tuple[Any, Any] | None] | None = None,
        colocated: str = "auto",
        colocated_max_bytes: int = 1 << 30,
        colocated_busy_poll_us: int = 0,
        nonfinite_observations: str = "refuse",
        text_step_timeout_s: float = 30.0,
        max_text_chars: int = 65536,
    ) -> None:
        self.name = name
        self.text_step_timeout_s, self.max_text_chars = text_step_timeout_s, max_text_chars
        self.nonfinite_observations = nonfinite_observations  # "refuse" or "clip" (EnvPool)
        # "auto": accept co-located rings from clients on this host; "off": decline every offer.
        self.colocated = colocated
        self.colocated_max_bytes = colocated_max_bytes
        # The thread serving the rings; it polls them this long after each answer (0: off).
        self.rings = RingServer(colocated_busy_poll_us)
        # Game links (env_server/game_link): the spaces a game declared for an env id that the
        # registry does not know, so a learner can ask for them like for any env (see _create).
        self.linked_spaces = linked_spaces
        self.max_sessions = max_sessions
        self.max_envs_per_session = max_envs_per_session
        # The server's send limit: render answers must fit in it (with room for the envelope).
        self.max_message_bytes = max_message_bytes
        self.max_render_bytes = max(1, max_message_bytes - _RENDER_ENVELOPE_BYTES)
        # A stream with no request for this long is ended (UNAVAILABLE) and its slot freed; 0: off.
        self.session_idle_timeout_s = session_idle_timeout_s
        self.active_sessions = 0
        self._gauge = _ACTIVE_SESSIONS.labels(name)
        self._steps = _ENV_STEPS.labels(name)
        self._colocated = _COLOCATED.labels(name)
        self._ids = itertools.count(1)

    async def ListEnvs(
        self, request: env_pb2.ListEnvsRequest, context: grpc.aio.ServicerContext
    ) -> env_pb2.ListEnvsResponse:
        entries = await asyncio.to_thread(registry.list_local_envs, request.filter)
        return env_pb2.ListEnvsResponse(envs=[e.to_proto() for e in entries])

    async def Session(
        self,
        requests: AsyncIterator[env_pb2.SessionRequest],
        context: grpc.aio.ServicerContext,
    ) -> None:
        # Reader/writer style (context.read/write; `requests` stays unused) rather than an async
        # generator: the server's interceptors wrap a generator handler in one more generator
        # each, a per-message cost; a coroutine is wrapped once per stream.
        session = _Session(self)
        idle_s = self.session_idle_timeout_s or None
        try:
            while not session.closed:
                try:
                    request = await session.read(context, idle_s)
                except TimeoutError:
                    await session.release()  # the slot is free before the client hears why
                    log.info("session idle for %gs: ending its stream", idle_s)
                    await abort_with(
                        context,
                        Unavailable(
                            f"server {self.name} ended this session: no request for {idle_s:g}s "
                            "(session_idle_timeout_s); its pool is closed, open a new session"
                        ),
                    )
                if request is grpc.aio.EOF:
                    return
                await context.write(await session.answer(request))
        finally:
            await session.release()

    def new_session_id(self) -> str:
        return f"{self.name}-{next(self._ids)}-{uuid.uuid4().hex[:8]}"

    def _acquire(self) -> None:
        if self.active_sessions >= self.max_sessions:
            raise ResourceExhausted(
                f"server {self.name} has {self.active_sessions} sessions, the limit "
                f"(max_sessions={self.max_sessions}); retry later or use another server"
            )
        self.active_sessions += 1
        self._gauge.set(self.active_sessions)

    def _release(self) -> None:
        self.active_sessions -= 1
        self._gauge.set(self.active_sessions)


class _Session:
    """The state of one Session stream: its pool, once created, and whether it holds a slot."""

    def __init__(self, service: EnvService) -> None:
        self.service = service
        self.pool: EnvPool | None = None
        self.text_pool: TextPool | None = None  # a pool of text envs (env_server/text)
        self.linked_env: str | None = None  # a game link's env id: spaces only, no pool
        self.closed = False
        self.ring: ServerRing | None = None  # the co-located fast path, once accepted
        # Held while the pool is in use: by the ring's thread for each step, by a gRPC request.
        self.pool_lock = threading.Lock()
        self._holds_slot = False

    async def read(self, context: grpc.aio.ServicerContext, idle_s: float | None) -> Any:
        """The next request; TimeoutError once neither the stream nor the ring has been used
        for `idle_s`."""
        if self.ring is None:
            async with asyncio.timeout(idle_s):
                return await context.read()
        # Steps come through the ring, so the stream may rightly be quiet for longer than idle_s:
        # the read is kept (never cancelled and restarted) while the ring is in use.
        reading = asyncio.ensure_future(context.read())
        try:
            wait = idle_s
            while True:
                done, _ = await asyncio.wait({reading}, timeout=wait)
                if done:
                    return reading.result()
                assert idle_s is not None  # no timeout: wait returns only when done
                wait = idle_s - (time.monotonic() - self.ring.last_used)
                if wait <= 0:
                    raise TimeoutError
        finally:
            if not reading.done():
                reading.cancel()

    async def answer(self, request: env_pb2.SessionRequest) -> env_pb2.SessionResponse:
        """One response for one request; errors become the response's `error`."""
        response = env_pb2.SessionResponse(request_id=request.request_id)
        kind = request.WhichOneof("request")
        try:
            if kind == "step" and self.text_pool is not None:
                await self._text_step(self.text_pool, request.step, response.step)
            elif kind == "step":
                with self._pool_in_hand():
                    self._step(request.step, response.step)
            elif kind == "reset" and self.text_pool is not None:
                await self._text_reset(self.text_pool, request.reset, response.reset)
            elif kind == "reset":
                with self._pool_in_hand():
                    self._reset(request.reset, response.reset)
            elif kind == "create":
                await self._create(request.create, response.create)
            elif kind == "render":
                with self._pool_in_hand():
                    frames = self._require_pool("render").render(
                        request.render.env_indices, max_bytes=self.service.max_render_bytes
                    )
                response.render.frames.CopyFrom(tensor.encode(frames))
            elif kind == "colocate":
                self._colocate(request.colocate, response.colocate)
            elif kind == "close":
                pool = self.pool or self.text_pool
                response.close.total_steps = pool.total_steps if pool else 0
                self.closed = True
            else:
                raise InvalidArgument("empty SessionRequest: set one of create/reset/step/...")
        except Exception as exc:
            if not isinstance(exc, RlfleetError):
                log.exception("session request %d (%s) failed", request.request_id, kind)
            response.ClearField("result")
            response.error.CopyFrom(to_status(exc))
        return response

    @contextlib.contextmanager
    def _pool_in_hand(self) -> Iterator[None]:
        """The pool for one gRPC request. Never waits (the event loop serves every session):
        while a co-located step holds the pool, FailedPrecondition, as a client gets for
        overlapping requests of one session."""
        if not self.pool_lock.acquire(blocking=False):
            raise FailedPrecondition(
                "a co-located step of this session is under way: one request at a time"
            )
        try:
            yield
        finally:
            self.pool_lock.release()

    def _require_pool(self, what: str) -> EnvPool:
        if self.linked_env is not None:
            raise FailedPrecondition(
                f"{what}: {self.linked_env} is driven by a game over GameLinkService; this "
                "session only reports its spaces"
            )
        if self.text_pool is not None:
            raise FailedPrecondition(f"{what}: text environments have no frames or rings")
        if self.pool is None:
            raise FailedPrecondition(f"{what} before create: send a CreateRequest first")
        return self.pool

    def _create_linked(self, req: env_pb2.CreateRequest, out: env_pb2.CreateResponse) -> bool:
        """A game link's env id: answer with the spaces its game declared in Hello (no pool).
        Before any game has linked with an id the registry lacks, UNAVAILABLE: retry."""
        linked = self.service.linked_spaces
        if linked is None:
            return False
        found = linked(req.env_id)
        if found is None:
            try:
                registry.find_env(req.env_id)
            except NotFound:
                raise Unavailable(
                    f"env id '{req.env_id}' is neither in this server's registry nor linked by "
                    "a game yet (GameLinkService): retry once the game has said Hello",
                    field="create.env_id",
                ) from None
            return False
        self.linked_env = req.env_id
        out.session_id = f"{self.service.name}-link-env-{next(self.service._ids)}"
        out.observation_space.CopyFrom(spaces.to_proto(found[0]))
        out.action_space.CopyFrom(spaces.to_proto(found[1]))
        out.num_envs = req.num_envs
        out.autoreset_mode = env_pb2.AUTORESET_MODE_SAME_STEP
        out.env.env_id, out.env.source = req.env_id, "game_link"
        return True

    async def _create(self, req: env_pb2.CreateRequest, out: env_pb2.CreateResponse) -> None:
        from gymnasium.vector import AutoresetMode

        if self.pool is not None or self.text_pool is not None:
            raise FailedPrecondition("this session already has a pool: create only once")
        limit = self.service.max_envs_per_session
        if req.num_envs < 1:
            raise InvalidArgument("num_envs must be >= 1", field="create.num_envs")
        if req.num_envs > limit:
            raise ResourceExhausted(
                f"num_envs={req.num_envs} is over this server's max_envs_per_session={limit}",
                field="create.num_envs",
            )
        if req.autoreset_mode not in _MODES:
            raise InvalidArgument(
                f"unknown autoreset_mode {req.autoreset_mode}; one of "
                + ", ".join(env_pb2.AutoresetMode.Name(m) for m in _MODES),
                field="create.autoreset_mode",
            )
        if req.HasField("seed"):
            _check_seed(req.seed, "create.seed")
        if req.render_mode not in _RENDER_MODES:
            raise InvalidArgument(
                f"render_mode {req.render_mode!r} is not supported: 'rgb_array' or empty (none)",
                field="create.render_mode",
            )
        kwargs = _plain_struct(req.kwargs, "create.kwargs")
        if "render_mode" in kwargs:
            raise InvalidArgument(
                "render_mode goes in CreateRequest.render_mode, not in kwargs",
                field="create.kwargs.render_mode",
            )
        if self._create_linked(req, out):
            return
        entry = registry.find_env(req.env_id)
        if entry.kind == "text":
            await self._create_text(req, out, entry, kwargs)
            return
        mode = AutoresetMode[_MODES[req.autoreset_mode]]
        self.pool = await self._build_pool(
            functools.partial(
                EnvPool,
                lambda: registry.make_env(
                    req.env_id, kwargs=kwargs, render_mode=req.render_mode or None
                ),
                req.num_envs,
                autoreset_mode=mode,
                seed=req.seed if req.HasField("seed") else None,
                float64_rewards=req.float64_rewards,
                nonfinite_observations=self.service.nonfinite_observations,
            )
        )
        out.session_id = self.service.new_session_id()
        out.observation_space.CopyFrom(spaces.to_proto(self.pool.observation_space))
        out.action_space.CopyFrom(spaces.to_proto(self.pool.action_space))
        out.num_envs = req.num_envs
        out.autoreset_mode = _PROTO_MODES[mode.name]
        out.env.CopyFrom(entry.to_proto())
        metadata = self.pool.metadata
        modes = metadata.get("render_modes") or ()
        out.render_modes.extend(m for m in _RENDER_MODES if m and m in modes)
        fps = metadata.get("render_fps")
        if isinstance(fps, int | float) and not isinstance(fps, bool) and math.isfinite(fps):
            out.render_fps = fps
        log.info("session %s: %d x %s (%s)", out.session_id, req.num_envs, req.env_id, mode.name)

    async def _create_text(
        self,
        req: env_pb2.CreateRequest,
        out: env_pb2.CreateResponse,
        entry: EnvEntry,
        kwargs: dict[str, Any],
    ) -> None:
        """A pool of text envs: reset by the client only (autoreset DISABLED), no frames."""
        if req.autoreset_mode not in (
            env_pb2.AUTORESET_MODE_UNSPECIFIED,
            env_pb2.AUTORESET_MODE_DISABLED,
        ):
            raise InvalidArgument(
                f"{req.env_id} is a text environment: its episodes are reset by the client "
                "(AUTORESET_MODE_DISABLED)",
                field="create.autoreset_mode",
            )
        if req.render_mode:
            raise InvalidArgument(
                f"{req.env_id} is a text environment: it renders no frames",
                field="create.render_mode",
            )
        service = self.service
        self.text_pool = await self._build_pool(
            functools.partial(
                TextPool,
                lambda: registry.make_text_env(req.env_id, kwargs=kwargs),
                req.num_envs,
                seed=req.seed if req.HasField("seed") else None,
                step_timeout_s=service.text_step_timeout_s,
                max_message_chars=service.max_text_chars,
            )
        )
        out.session_id = service.new_session_id()
        out.num_envs = req.num_envs
        out.autoreset_mode = env_pb2.AUTORESET_MODE_DISABLED
        out.env.CopyFrom(entry.to_proto())
        out.tools.extend(info_struct(tool) for tool in self.text_pool.tools)
        log.info("session %s: %d x %s (text)", out.session_id, req.num_envs, req.env_id)

    async def _text_reset(
        self, pool: TextPool, req: env_pb2.ResetRequest, out: env_pb2.ResetResponse
    ) -> None:
        if req.HasField("seed"):
            _check_seed(req.seed, "reset.seed")
        options = _plain_struct(req.options, "reset.options") if req.HasField("options") else None
        seeds = _seeds(req.seeds, pool.num_envs) if req.seeds else None
        turns = await asyncio.to_thread(  # an env may take its time (tools, subprocesses)
            pool.reset,
            seed=req.seed if req.HasField("seed") else None,
            seeds=seeds,
            indices=req.env_indices,
            options=options,
        )
        out.texts.extend(turn_to_proto(turn) for turn in turns)

    async def _text_step(
        self, pool: TextPool, req: env_pb2.StepRequest, out: env_pb2.StepResponse
    ) -> None:
        if req.HasField("actions"):
            raise InvalidArgument(
                "a text environment steps on text_actions (assistant messages), not tensors",
                field="step.actions",
            )
        if len(req.text_actions) > pool.num_envs:  # bounded before anything is converted
            raise InvalidArgument(
                f"{len(req.text_actions)} text actions for a pool of {pool.num_envs} envs",
                field="step.text_actions",
            )
        messages = [message_from_proto(m) for m in req.text_actions]
        result = await asyncio.to_thread(pool.step, req.env_indices, messages)
        self.service._steps.inc(len(result.env_indices))
        out.rewards.CopyFrom(tensor.encode(np.asarray(result.rewards, dtype=np.float32)))
        out.terminated.CopyFrom(tensor.encode(np.asarray(result.terminated, dtype=bool)))
        out.truncated.CopyFrom(tensor.encode(np.asarray(result.truncated, dtype=bool)))
        out.texts.extend(turn_to_proto(turn) for turn in result.turns)
        _add_episodes(out, result.episodes)

    async def _build_pool(self, build: Callable[[], PoolT]) -> PoolT:
        """``build()`` in a thread (pygame, sprites, a user's env take seconds) holding a session
        slot; cancelled (client gone) while the thread builds, the pool is closed once built."""
        self.service._acquire()
        self._holds_slot = True
        building = asyncio.ensure_future(asyncio.to_thread(build))
        try:
            return await asyncio.shield(building)
        except BaseException:
            building.add_done_callback(_close_built_pool)
            await self.release()
            raise

    def _colocate(self, req: env_pb2.ColocateRequest, out: env_pb2.ColocateResponse) -> None:
        """Attach the client's ring (docs/colocated.md), or say why not (it then uses gRPC)."""
        service = self.service
        pool = self._require_pool("colocate")
        if self.ring is not None and self.ring.open:
            raise FailedPrecondition("this session already steps through a co-located ring")
        outcome = _COLOCATE_OFFERS.labels(service.name, "declined")
        try:
            if service.colocated == "off":
                raise Declined(f"server {service.name} has colocated: off")
            self.ring = ServerRing(
                pool,
                req,
                pool_lock=self.pool_lock,
                server=service.rings,
                max_bytes=service.colocated_max_bytes,
                on_steps=service._steps.inc,
                on_close=service._colocated.dec,
            )
        except Declined as exc:
            out.accepted, out.reason = False, str(exc)
            outcome.inc()
            return
        except RlfleetError:
            _COLOCATE_OFFERS.labels(service.name, "rejected").inc()
            raise
        service._colocated.inc()
        _COLOCATE_OFFERS.labels(service.name, "accepted").inc()
        out.accepted = True
        log.info("session of %d envs steps through a co-located ring", pool.num_envs)

    def _reset(self, req: env_pb2.ResetRequest, out: env_pb2.ResetResponse) -> None:
        pool = self._require_pool("reset")
        if req.HasField("seed"):
            _check_seed(req.seed, "reset.seed")
        options = _plain_struct(req.options, "reset.options") if req.HasField("options") else None
        seeds = _seeds(req.seeds, pool.num_envs) if req.seeds else None
        obs, infos = pool.reset(
            seed=req.seed if req.HasField("seed") else None,
            seeds=seeds,
            indices=req.env_indices,  # the pool checks its length before copying it
            options=options,
        )
        out.observations.CopyFrom(tensor.encode_tree(obs))
        if infos:
            out.infos.CopyFrom(tensor.encode_tree(infos))

    def _step(self, req: env_pb2.StepRequest, out: env_pb2.StepResponse) -> None:
        pool = self._require_pool("step")
        actions = tensor.decode_tree(req.actions, name="actions")
        actions = spaces.validate_actions(pool.action_space, actions, pool.num_envs)
        before = pool.total_steps
        result: StepResult = pool.step(actions)
        self.service._steps.inc(pool.total_steps - before)
        out.observations.CopyFrom(tensor.encode_tree(result.observations))
        out.rewards.CopyFrom(tensor.encode(result.rewards))
        out.terminated.CopyFrom(tensor.encode(result.terminated))
        out.truncated.CopyFrom(tensor.encode(result.truncated))
        if result.final_observations is not None:
            out.final_observations.CopyFrom(tensor.encode_tree(result.final_observations))
        if result.infos:
            out.infos.CopyFrom(tensor.encode_tree(result.infos))
        _add_episodes(out, result.episodes)

    async def release(self) -> None:
        """Close the ring and the pool, and free the session slot (idempotent)."""
        ring, self.ring = self.ring, None
        if ring is not None:
            ring.close()
        text_pool, self.text_pool = self.text_pool, None
        if text_pool is not None:  # its envs may hang in close: a thread, not waited for long
            with contextlib.suppress(asyncio.CancelledError, TimeoutError):
                await asyncio.wait_for(asyncio.shield(asyncio.to_thread(text_pool.close)), 10)
        pool, self.pool = self.pool, None
        if pool is not None:
            # Shielded: the stream may be ending because it was cancelled, and the envs must
            # still be closed (pygame windows, subprocesses of wrapped envs). In a thread that
            # takes the pool lock: a ring step may still be under way.
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.shield(asyncio.to_thread(_close_when_free, pool, self.pool_lock))
        if self._holds_slot:
            self._holds_slot = False
            self.service._release()


def _add_episodes(out: env_pb2.StepResponse, episodes: Sequence[EpisodeStats]) -> None:
    for ep in episodes:
        out.episodes.add(
            env_index=ep.env_index,
            episode_return=ep.episode_return,
            length=ep.length,
            truncated=ep.truncated,
            score=ep.score,  # None leaves the optional field unset
        )


def _close_when_free(pool: EnvPool, lock: threading.Lock) -> None:
    with lock:
        pool.close()


def _close_built_pool(task: asyncio.Future[Any]) -> None:
    if not task.cancelled() and task.exception() is None:
        task.result().close()


def _check_seed(seed: int, field: str) -> None:
    if seed < 0:
        raise InvalidArgument(f"seed must be >= 0 (gymnasium seeds), got {seed}", field=field)


def _seeds(values: Sequence[int], num_envs: int) -> list[int | None]:
    """ResetRequest.seeds as gymnasium seeds (-1: None), bounded before anything is copied."""
    if len(values) > num_envs:
        raise InvalidArgument(
            f"{len(values)} seeds for a pool of {num_envs} envs (one per env reset)",
            field="reset.seeds",
        )
    seeds = list(values)
    if any(s < -1 for s in seeds):
        raise InvalidArgument(
            f"seeds must be >= 0 (or -1: keep the env's RNG), got {seeds}", field="reset.seeds"
        )
    return [None if s == -1 else s for s in seeds]


def _plain_struct(msg: struct_pb2.Struct, field: str) -> dict[str, Any]:
    """A Struct as plain Python values; NaN/inf anywhere is InvalidArgument naming its path."""
    return {k: _plain(v, f"{field}.{k}") for k, v in msg.fields.items()}


def _plain(value: struct_pb2.Value, field: str) -> Any:
    """Struct numbers are doubles: integral ones come back as ints (env kwargs expect them)."""
    kind = value.WhichOneof("kind")
    if kind == "number_value":
        number = value.number_value
        if not math.isfinite(number):
            raise InvalidArgument(f"{field}: {number} is not a finite number", field=field)
        return int(number) if number.is_integer() else number
    if kind == "string_value":
        return value.string_value
    if kind == "bool_value":
        return value.bool_value
    if kind == "struct_value":
        return _plain_struct(value.struct_value, field)
    if kind == "list_value":
        return [_plain(v, f"{field}[{i}]") for i, v in enumerate(value.list_value.values)]
    return None  # null_value (or no kind at all)
