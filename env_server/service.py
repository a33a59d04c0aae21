"""The `env_server` service kind: `rlfleet serve env_server` and the launcher run this."""

from __future__ import annotations

import logging

from pydantic import Field, field_validator

from env_server import registry
from env_server.servicer import EnvService
from rlfleet.env.v1 import env_pb2, env_pb2_grpc
from services.config import StrictModel
from services.errors import RlfleetError
from services.grpc_names import service_name
from services.registry import ServiceContext, ServiceSpec
from services.server import DEFAULT_MAX_MESSAGE_BYTES, GrpcServer

__all__ = ["SPEC", "EnvServerSettings", "main"]

log = logging.getLogger(__name__)


class EnvServerSettings(StrictModel):
    """Settings of an env server (YAML `settings:` or RLFLEET_ENV_SERVER__<KEY>)."""

    max_sessions: int = Field(default=64, ge=1)  # concurrent Session streams holding a pool
    max_envs_per_session: int = Field(default=1024, ge=1)  # CreateRequest.num_envs limit
    max_message_bytes: int = Field(default=DEFAULT_MAX_MESSAGE_BYTES, ge=1 << 20)
    # Env ids created once at start so a typo or a missing package fails the start, not a run;
    # "module:Id" imports `module` first (third-party gymnasium packages).
    preload: list[str] = Field(default_factory=list)

    @field_validator("preload")
    @classmethod
    def _known_ids(cls, env_ids: list[str]) -> list[str]:
        # Plain ids are checked against this install's registry when the config is validated;
        # "module:Id" needs its module imported, which only the start does.
        for env_id in env_ids:
            if ":" not in env_id:
                try:
                    registry.find_env(env_id)
                except RlfleetError as exc:
                    raise ValueError(str(exc)) from None
        return env_ids


async def main(ctx: ServiceContext[EnvServerSettings]) -> None:
    """Serve EnvService until ctx.stop_event is set."""
    settings = ctx.settings
    registry.preload(settings.preload)
    service = EnvService(
        name=ctx.name,
        max_sessions=settings.max_sessions,
        max_envs_per_session=settings.max_envs_per_session,
    )
    server = GrpcServer(
        ctx.name, host=ctx.host, port=ctx.port, max_message_bytes=settings.max_message_bytes
    )
    server.add_service(env_pb2_grpc.add_EnvServiceServicer_to_server, service, SERVICE_NAME)
    await server.start()
    server.set_serving()
    log.info("env_server %s serving on %s", ctx.name, server.address)
    await server.serve_until(ctx.stop_event)


SERVICE_NAME = service_name(env_pb2, "EnvService")
SPEC = ServiceSpec(kind="env_server", settings=EnvServerSettings, main=main)
