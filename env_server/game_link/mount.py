"""GameLinkService mounted on the env server: its bus, weights, hub, links and servicer, started
and stopped with the server (env_server/service.py)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from clients.learner import WeightFollower
from env_server.game_link.hub import PolicyHub
from env_server.game_link.links import LinkRegistry
from env_server.game_link.servicer import GameLinkService
from env_server.game_link.settings import GameLinkSettings
from rlfleet.env.v1 import game_link_pb2, game_link_pb2_grpc
from services.bus import Bus, stream_name, traj_subject
from services.errors import ConfigError
from services.grpc_names import service_name
from services.registry import ServiceContext
from services.server import GrpcServer
from services.waits import bus_say, waiting

__all__ = ["SERVICE_NAME", "GameLinkMount"]

log = logging.getLogger(__name__)

SERVICE_NAME = service_name(game_link_pb2, "GameLinkService")


class GameLinkMount:
    """Everything GameLinkService needs, for one env server."""

    def __init__(
        self, ctx: ServiceContext[Any], settings: GameLinkSettings, *, nonfinite: str = "refuse"
    ) -> None:
        self.ctx, self.settings = ctx, settings
        self.nonfinite = nonfinite  # the env server's nonfinite_observations
        self.bus: Bus | None = None
        self.follower: WeightFollower | None = None
        self.hub = PolicyHub(settings, None)
        self.links: LinkRegistry | None = None
        self.service: GameLinkService | None = None
        self._pending: _Deferred = _Deferred()
        self._first_game: asyncio.Task[bool] | None = None  # says what the server waits for

    def spaces(self, env_id: str) -> tuple[Any, Any] | None:
        return self.hub.spaces(env_id)

    def add_to(self, server: GrpcServer) -> None:
        """Register the servicer (before the server starts); it serves once `start` ran."""
        server.add_service(
            game_link_pb2_grpc.add_GameLinkServiceServicer_to_server, self._pending, SERVICE_NAME
        )

    async def start(self, address: str) -> None:
        ctx, settings = self.ctx, self.settings
        if ctx.nats_url:
            self.bus = await Bus.connect(ctx.nats_url, name=f"{ctx.name}-game-link")
        elif settings.publishes or settings.policy == "learner":
            raise ConfigError(
                f"env server {ctx.name}: game_link needs a NATS url (RLFLEET_NATS_URL)"
            )
        if self.bus is not None and settings.publishes:
            await self.bus.ensure_stream(stream_name(ctx.run_name), [traj_subject(ctx.run_name)])
        if settings.policy == "learner":
            assert self.bus is not None
            learner = ctx.resolve(settings.learner or "")
            self.follower = WeightFollower(self.bus, ctx.run_name, learner)
            await self.follower.start()
            self.hub.follower = self.follower
        self.hub.start(ctx.stop_event)
        self.links = LinkRegistry(
            settings, self.hub, server=ctx.name, address=address, run=ctx.run_name, bus=self.bus
        )
        self.links.start()
        if settings.publishes:  # a run whose data comes from games waits for the first one
            self._first_game = asyncio.create_task(
                waiting(
                    f"a game to link at {address} ({SERVICE_NAME})",
                    self.links.linked.wait(),
                    say=bus_say(self.bus, ctx.run_name, ctx.name),
                ),
                name="first-game",
            )
        self.service = GameLinkService(
            settings, self.hub, self.links, clip_nonfinite=self.nonfinite == "clip"
        )
        self._pending.target = self.service
        log.info(
            "game links on %s: policy %s, T=%d, fragments %s",
            address,
            settings.policy,
            settings.rollout_length,
            "on" if settings.publishes else "off",
        )

    async def stop(self) -> None:
        if self._first_game is not None:
            self._first_game.cancel()
        if self.service is not None:
            await self.service.shutdown()
        await self.hub.close()
        if self.follower is not None:
            await self.follower.close()
        if self.bus is not None:
            with contextlib.suppress(Exception):
                await self.bus.close()


class _Deferred(game_link_pb2_grpc.GameLinkServiceServicer):
    """The servicer gRPC holds from the start; calls go to the real one once it exists (the
    bus and the bound address come after the server has started)."""

    CALLERS = GameLinkService.CALLERS  # what gRPC sees is this servicer: the same rights

    def __init__(self) -> None:
        self.target: GameLinkService | None = None

    async def Connect(self, requests: Any, context: Any) -> None:
        from services.errors import Unavailable, abort_with

        if self.target is None:
            await abort_with(context, Unavailable("game links are starting: retry"))
        assert self.target is not None
        await self.target.Connect(requests, context)
