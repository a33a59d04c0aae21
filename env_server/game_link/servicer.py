"""`rlfleet.env.v1.GameLinkService`: the Connect stream of one game instance.

Two tasks per stream. The reader takes requests in order and checks them (protocol.py); an
observation batch goes to the hub at once, so the policy can work on it while earlier replies
are still being written, and the reader stops reading while the granted number of observations
is unanswered (the rest waits in gRPC flow control). The writer answers in request order: it
waits for each batch's decision, records the tick in the link (only answered ticks are
recorded, so what a broken stream had in flight is discarded, as the proto says) and writes
the reply. In-band errors come from services.errors.to_status, like EnvService's.

Fatal ends: a takeover (another stream said Hello with this link's session key) ends the
stream ABORTED; the server stopping ends every stream UNAVAILABLE.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc

from common import tensor
from env_server.game_link.hub import PolicyHub
from env_server.game_link.links import Link, LinkRegistry
from env_server.game_link.protocol import PROTOCOL_VERSIONS, Tick, check_hello, check_tick
from env_server.game_link.settings import GameLinkSettings
from rlfleet.env.v1 import game_link_pb2, game_link_pb2_grpc
from services.errors import (
    FailedPrecondition,
    InvalidArgument,
    RlfleetError,
    Unavailable,
    abort_with,
    to_status,
)

__all__ = ["Aborted", "GameLinkService"]

log = logging.getLogger(__name__)


class Aborted(RlfleetError):
    """The link was taken over by a newer stream (reconnect with the same session key)."""

    code = grpc.StatusCode.ABORTED


_EOF = object()


class GameLinkService(game_link_pb2_grpc.GameLinkServiceServicer):
    """Connect streams over the links of a LinkRegistry and the policy of a PolicyHub."""

    # Who may call, by certificate kind (services/security.py; the launcher may call all):
    # games, from outside the run or started by it as a `process` service.
    CALLERS = {"Connect": frozenset({"game_client", "process"})}

    def __init__(
        self,
        settings: GameLinkSettings,
        hub: PolicyHub,
        links: LinkRegistry,
        *,
        clip_nonfinite: bool = False,
    ) -> None:
        self.settings, self.hub, self.links = settings, hub, links
        # NaN/inf observations: clipped (True), else refused in-band (protocol.check_tick).
        self.clip_nonfinite = clip_nonfinite
        self.streams: set[_Stream] = set()
        self.stopping = False

    async def Connect(
        self,
        requests: AsyncIterator[game_link_pb2.ConnectRequest],
        context: grpc.aio.ServicerContext,
    ) -> None:
        if self.stopping:
            await abort_with(context, Unavailable("the env server is shutting down"))
        stream = _Stream(self, context)
        self.streams.add(stream)
        try:
            await stream.run()
        finally:
            self.streams.discard(stream)

    async def shutdown(self) -> None:
        """End every stream UNAVAILABLE, then every link (its transitions published)."""
        self.stopping = True
        streams = list(self.streams)
        for stream in streams:
            stream.abort(Unavailable("the env server is shutting down: reconnect elsewhere"))
        for stream in streams:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(5.0):
                    await stream.released.wait()
        await self.links.close()


class _Stream:
    def __init__(self, service: GameLinkService, context: grpc.aio.ServicerContext) -> None:
        self.service = service
        self.context = context
        self.link: Link | None = None
        self.granted = 1
        self.in_flight = 0
        self._room = asyncio.Event()
        self._out: asyncio.Queue[Any] = asyncio.Queue()
        self._futures: list[asyncio.Future[Any]] = []
        self._fatal: RlfleetError | None = None
        self._fatal_set = asyncio.Event()
        self.released = asyncio.Event()  # let go of its link
        self._said_goodbye = False

    def abort(self, error: RlfleetError) -> None:
        if self._fatal is None:
            self._fatal = error
            self._fatal_set.set()

    async def take_over(self) -> None:
        self.abort(Aborted("this game link was taken over by a newer stream with its session key"))
        await self.released.wait()

    async def run(self) -> None:
        reader = asyncio.create_task(self._read(), name="game-link-read")
        writer = asyncio.create_task(self._write(), name="game-link-write")
        fatal = asyncio.create_task(self._fatal_set.wait())
        try:
            waiting = {writer, fatal, reader}
            while writer in waiting and fatal in waiting:
                done, waiting = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
                if reader in done and reader.exception() is not None:
                    break  # e.g. bytes that do not decode: the stream ends with that error
        finally:
            for task in (reader, writer, fatal):
                task.cancel()
            await asyncio.gather(reader, writer, fatal, return_exceptions=True)
            for future in self._futures:
                future.cancel()
            self._release()
        for task in (reader, writer):
            if task.done() and not task.cancelled() and task.exception() is not None:
                raise task.exception()  # type: ignore[misc]
        if self._fatal is not None:
            await abort_with(self.context, self._fatal)

    def _release(self) -> None:
        if self.link is not None and not self._said_goodbye:
            # A takeover or shutdown decides about the link itself; a plain break waits for
            # a resume.
            self.service.links.detach(self.link, self, keep=self._fatal is None)
        self.released.set()

    # ------------------------------------------------------------------ reading

    async def _read(self) -> None:
        context = self.context
        while True:
            while self.in_flight >= self.granted:
                self._room.clear()
                await self._room.wait()
            request = await context.read()
            if request is grpc.aio.EOF:
                self._out.put_nowait(_EOF)
                return
            kind = request.WhichOneof("request")
            try:
                if kind == "observations":
                    if self.link is not None:
                        await self.service.links.pace(self.link)
                    self._observe(request)
                    continue
                if kind == "hello":
                    self._ready(request, welcome=await self._hello(request.hello))
                elif kind == "goodbye":
                    if self.link is None:
                        raise FailedPrecondition("Goodbye before Hello: there is no link to end")
                    self._out.put_nowait(("goodbye", request.request_id))
                    return
                else:
                    raise InvalidArgument(
                        "empty ConnectRequest: set one of hello/observations/goodbye",
                        field="request",
                    )
            except Exception as exc:
                if not isinstance(exc, RlfleetError):
                    log.exception("game link request %d (%s) failed", request.request_id, kind)
                self._ready(request, error=to_status(exc))

    def _ready(self, request: Any, **result: Any) -> None:
        self._out.put_nowait(game_link_pb2.ConnectResponse(request_id=request.request_id, **result))

    async def _hello(self, hello: game_link_pb2.Hello) -> game_link_pb2.Welcome:
        if self.link is not None:
            raise FailedPrecondition("a second Hello: this stream's link is already open")
        settings = self.service.settings
        spec = check_hello(hello, max_agents=settings.max_agents_per_link)
        link, resumed = await self.service.links.open(spec, self)
        self.link = link
        self.granted = min(spec.max_in_flight, settings.max_in_flight)
        hub = self.service.hub
        return game_link_pb2.Welcome(
            link_id=link.link_id,
            protocol_version=PROTOCOL_VERSIONS[-1],
            max_in_flight=self.granted,
            resumed=resumed,
            last_tick=link.recorder.last_tick if resumed else 0,
            resume_window_s=settings.resume_window_s,
            run=self.service.links.run,
            policy_version=hub.version if hub.ready else 0,
            policy_loaded=hub.ready,
            policy=settings.policy,
        )

    def _observe(self, request: game_link_pb2.ConnectRequest) -> None:
        link = self.link
        if link is None:
            raise FailedPrecondition("observations before Hello: open the link first")
        tick = check_tick(
            request.observations, link.spec, link.cursor, clip=self.service.clip_nonfinite
        )
        link.cursor.advance(tick)
        future = self.service.hub.decide(link.spec.env_id, tick.obs)
        self._futures.append(future)
        self.in_flight += 1
        self._out.put_nowait(("tick", request.request_id, tick, future))

    # ------------------------------------------------------------------ writing

    async def _write(self) -> None:
        context = self.context
        while True:
            item = await self._out.get()
            if item is _EOF:
                return  # the client half-closed without Goodbye: a break
            if isinstance(item, game_link_pb2.ConnectResponse):
                await context.write(item)
                continue
            if item[0] == "goodbye":
                await context.write(await self._goodbye(item[1]))
                return
            _, request_id, tick, future = item
            await context.write(await self._answer(request_id, tick, future))
            self._futures.remove(future)
            self.in_flight -= 1
            self._room.set()

    async def _answer(
        self, request_id: int, tick: Tick, future: asyncio.Future[Any]
    ) -> game_link_pb2.ConnectResponse:
        response = game_link_pb2.ConnectResponse(request_id=request_id)
        try:
            decision, version = await future
        except RlfleetError as exc:
            response.error.CopyFrom(to_status(exc))
            return response
        assert self.link is not None
        self.service.links.answered(self.link, tick, decision, version)
        response.actions.tick = tick.tick
        response.actions.actions.CopyFrom(tensor.encode_tree(decision.env_actions))
        response.actions.policy_version = version
        return response

    async def _goodbye(self, request_id: int) -> game_link_pb2.ConnectResponse:
        link = self.link
        assert link is not None
        self._said_goodbye = True
        recorder = link.recorder
        farewell = game_link_pb2.Farewell(ticks=recorder.ticks, episodes=recorder.episodes)
        link.owner = None
        self.service.links.end(link)
        return game_link_pb2.ConnectResponse(request_id=request_id, farewell=farewell)
