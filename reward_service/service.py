"""The `reward_service` service kind: `rlfleet serve reward_service` and the launcher run this."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from importlib import metadata

from reward_service.models import ModelReward, model_reward_function
from reward_service.rewards.catalog import load_registry
from reward_service.rewards.registry import RewardFunction, RewardRegistry
from reward_service.servicer import RewardService
from reward_service.settings import RewardModelSettings, RewardSettings
from reward_service.validation import check_kwargs
from rlfleet.reward.v1 import reward_pb2, reward_pb2_grpc
from services.errors import ConfigError, InvalidArgument
from services.grpc_names import service_name
from services.membership import registered
from services.registry import ServiceContext, ServiceSpec
from services.server import GrpcServer
from services.start_order import needs_nothing

__all__ = ["SERVICE_NAME", "SPEC", "RewardSettings", "build_registry", "main", "serve"]

log = logging.getLogger(__name__)

SERVICE_NAME = service_name(reward_pb2, "RewardService")


def _model(spec: RewardModelSettings) -> ModelReward:
    return ModelReward(
        spec.name,
        spec.path,
        max_length=spec.max_length,
        batch_size=spec.batch_size,
        device=spec.device,
    )


def _load(model: ModelReward) -> None:
    try:
        model.load()
    except Exception as exc:
        raise ConfigError(
            f"reward model '{model.name}' ({model.path}) failed to load: "
            f"{type(exc).__name__}: {exc}"
        ) from exc


def build_registry(
    settings: RewardSettings,
    *,
    entry_points: Iterable[metadata.EntryPoint] | None = None,
    extra_entry_points: Iterable[metadata.EntryPoint] = (),
) -> tuple[RewardRegistry, list[ModelReward]]:
    """Every reward this server runs (models not loaded yet; the run file's references imported),
    with the settings checked against it: a default set, kwargs or timeout naming an unknown
    reward fails the start."""
    models = [_model(spec) for spec in settings.reward_models]
    records: list[RewardFunction] = [
        model_reward_function(m, timeout_s=spec.timeout_s, description=spec.description)
        for m, spec in zip(models, settings.reward_models, strict=True)
    ]
    registry = load_registry(
        entry_points=entry_points,
        extra_entry_points=extra_entry_points,
        models=records,
        references=settings.references,
    )
    known = ", ".join(registry)
    for key, names in (
        ("rewards", settings.rewards),
        ("reward_kwargs", settings.reward_kwargs),
        ("timeouts", settings.timeouts),
    ):
        for name in names:
            if name not in registry:
                raise ConfigError(f"settings.{key}: unknown reward '{name}' (known: {known})")
    for name, kwargs in settings.reward_kwargs.items():
        try:
            check_kwargs(registry[name], kwargs, f"settings.reward_kwargs.{name}")
        except InvalidArgument as exc:
            raise ConfigError(str(exc)) from None
    return registry, models


async def serve(
    ctx: ServiceContext[RewardSettings],
    *,
    entry_points: Iterable[metadata.EntryPoint] | None = None,
    extra_entry_points: Iterable[metadata.EntryPoint] = (),
) -> None:
    """Serve RewardService until ctx.stop_event is set; tests add plugins without installing a
    package through ``extra_entry_points``."""
    settings = ctx.settings
    registry, models = build_registry(
        settings, entry_points=entry_points, extra_entry_points=extra_entry_points
    )
    service = RewardService(registry, settings, name=ctx.name)
    server = GrpcServer(
        ctx.name, host=ctx.host, port=ctx.port, max_message_bytes=settings.max_message_bytes
    )
    server.add_service(reward_pb2_grpc.add_RewardServiceServicer_to_server, service, SERVICE_NAME)
    await server.start()
    try:
        # Health stays NOT_SERVING (and Score names the model UNAVAILABLE) until every model
        # has loaded; a model that cannot load fails the start.
        await asyncio.gather(*(asyncio.to_thread(_load, m) for m in models))
        async with registered(ctx, server.port, load=lambda: service.active):
            server.set_serving()
            log.info(
                "reward_service %s serving %d rewards on %s",
                ctx.name,
                len(registry),
                server.address,
            )
            await ctx.stop_event.wait()
    finally:
        await server.stop()
        service.close()


async def main(ctx: ServiceContext[RewardSettings]) -> None:
    """Serve RewardService with the installed plugins until ctx.stop_event is set."""
    await serve(ctx)


# It calls no other service: it may start at once.
SPEC = ServiceSpec(
    kind="reward_service",
    settings=RewardSettings,
    main=main,
    needs=needs_nothing,
)
