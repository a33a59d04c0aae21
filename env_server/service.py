"""The `env_server` service kind: `rlfleet serve env_server` and the launcher run this."""

from __future__ import annotations

import logging
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator

from clients.env import SERVICE_NAME
from env_server import registry
from env_server.game_link.mount import GameLinkMount
from env_server.game_link.settings import GameLinkSettings
from env_server.servicer import EnvService
from rlfleet.env.v1 import env_pb2_grpc
from services.config import StrictModel, Switch
from services.errors import RlfleetError
from services.membership import registered
from services.registry import ServiceContext, ServiceSpec
from services.server import DEFAULT_MAX_MESSAGE_BYTES, GrpcServer

__all__ = ["SPEC", "EnvServerSettings", "main"]

log = logging.getLogger(__name__)


class PreloadEnv(StrictModel):
    """An env id to create-check at start with the arguments it needs (an env whose constructor
    has required ones, as ``OpenEnvText-v0``'s ``env``)."""

    env_id: str
    kwargs: dict[str, Any] = Field(default_factory=dict)


class EnvServerSettings(StrictModel):
    """Settings of an env server (YAML `settings:` or RLFLEET_ENV_SERVER__<KEY>)."""

    max_sessions: int = Field(default=64, ge=1)  # concurrent Session streams holding a pool
    max_envs_per_session: int = Field(default=1024, ge=1)  # CreateRequest.num_envs limit
    max_message_bytes: int = Field(default=DEFAULT_MAX_MESSAGE_BYTES, ge=1 << 20)
    # A Session stream with no request for this long is ended with UNAVAILABLE and its pool
    # closed, so idle clients cannot hold every slot; 0 turns it off.
    session_idle_timeout_s: float = Field(default=600.0, ge=0)
    # The co-located fast path (docs/colocated.md): "auto" lets a client on this host step
    # through a shared-memory ring it offers; "off" declines every offer (clients use gRPC).
    colocated: Annotated[Literal["auto", "off"], Switch] = "auto"
    # The largest ring a session may attach (all slots), against a client that asks for much.
    colocated_max_bytes: int = Field(default=1 << 30, ge=1 << 20)
    # After answering a ring step, poll every ring for the next one until this long
    # (microseconds) passes without one, before sleeping: no wake-up per step, at the cost of a
    # busy core, and gRPC requests wait while it polls. Where cores are spare; 0 (off) by default.
    colocated_busy_poll_us: int = Field(default=0, ge=0, le=10_000)
    # Env ids created once at start so a typo or a missing package fails the start, not a run.
    # References ("module:Name", "path/to/file.py:Name", relative to the current directory; a
    # gymnasium Env class, a factory, or an id the module registers) become ids of this server.
    # An entry {env_id, kwargs} creates it with those arguments.
    preload: list[str | PreloadEnv] = Field(default_factory=list)
    # NaN/inf in an observation, from an env (EnvService) or a game (GameLinkService): "refuse"
    # answers that step in-band with INVALID_ARGUMENT naming the env or agent (its row) and the
    # field, so it never reaches a fragment and a learner; "clip" turns NaN into 0 and inf into
    # the space's bound (the dtype's largest value where that is infinite) and goes on.
    nonfinite_observations: Literal["refuse", "clip"] = "refuse"
    # GameLinkService on the same port: games that own their loop (env_server/game_link).
    game_link: GameLinkSettings = GameLinkSettings()
    # On a stop, first say so in the run's membership (services/membership.py) and wait this
    # long for the actors' sessions to move to other env servers, so none is cut mid-step.
    drain_timeout_s: float = Field(default=8.0, ge=0, le=300)
    # Text environments (env_server/text): a reset or step of one env that takes longer ends
    # its episode truncated ("step_timeout") instead of holding the session; the model's
    # messages over max_text_chars are refused (INVALID_ARGUMENT).
    text_step_timeout_s: float = Field(default=30.0, gt=0, le=3600)
    max_text_chars: int = Field(default=65536, ge=256)

    @field_validator("preload")
    @classmethod
    def _known_ids(cls, entries: list[str | PreloadEnv]) -> list[str | PreloadEnv]:
        # Checked when the config is validated: plain ids against this install's registry,
        # references by importing them (a factory's result is checked at the start).
        for env_id in (e if isinstance(e, str) else e.env_id for e in entries):
            if registry.is_reference(env_id):
                registry.check_reference(env_id)
                continue
            try:
                registry.find_env(env_id)
            except RlfleetError as exc:
                raise ValueError(str(exc)) from None
        return entries

    def preload_ids(self) -> tuple[list[str], dict[str, dict[str, Any]]]:
        """``preload`` as ids and the arguments of those that have some."""
        ids = [e if isinstance(e, str) else e.env_id for e in self.preload]
        return ids, {e.env_id: e.kwargs for e in self.preload if isinstance(e, PreloadEnv)}


async def main(ctx: ServiceContext[EnvServerSettings]) -> None:
    """Serve EnvService (and GameLinkService when enabled) until ctx.stop_event is set."""
    settings = ctx.settings
    registry.preload(*settings.preload_ids())
    links = (
        GameLinkMount(ctx, settings.game_link, nonfinite=settings.nonfinite_observations)
        if settings.game_link.enabled
        else None
    )
    service = EnvService(
        name=ctx.replica,  # this replica's own name: metric labels, session ids (replica_name)
        max_sessions=settings.max_sessions,
        max_envs_per_session=settings.max_envs_per_session,
        max_message_bytes=settings.max_message_bytes,
        session_idle_timeout_s=settings.session_idle_timeout_s,
        colocated=settings.colocated,
        colocated_max_bytes=settings.colocated_max_bytes,
        colocated_busy_poll_us=settings.colocated_busy_poll_us,
        linked_spaces=links.spaces if links is not None else None,
        nonfinite_observations=settings.nonfinite_observations,
        text_step_timeout_s=settings.text_step_timeout_s,
        max_text_chars=settings.max_text_chars,
    )
    server = GrpcServer(
        ctx.name, host=ctx.host, port=ctx.port, max_message_bytes=settings.max_message_bytes
    )
    server.add_service(env_pb2_grpc.add_EnvServiceServicer_to_server, service, SERVICE_NAME)
    if links is not None:
        links.add_to(server)
    await server.start()
    try:
        async with registered(ctx, server.port, load=lambda: service.active_sessions) as member:
            if links is not None:
                await links.start(server.address)
            server.set_serving()
            log.info("env_server %s serving on %s", ctx.name, server.address)
            await ctx.stop_event.wait()
            if member is not None and service.active_sessions:
                log.info("draining: %d sessions to move elsewhere", service.active_sessions)
                await member.drain(lambda: not service.active_sessions, settings.drain_timeout_s)
    finally:
        if links is not None:
            await links.stop()  # streams end UNAVAILABLE, links publish what they hold
        await server.stop()


SPEC = ServiceSpec(
    kind="env_server",
    settings=EnvServerSettings,
    main=main,
    # While games are linked (their links report it: services/producers.py).
    produces=lambda s: (
        "rollout fragments" if s.game_link.enabled and s.game_link.publishes else None
    ),
)
