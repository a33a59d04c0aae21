"""The `gateway` service kind: the OpenAI HTTP API (gateway/app.py) in front of serving samplers.

grpc=True: beside the HTTP port the gateway runs a gRPC server with only the standard health
service, so the launcher (which waits for gRPC health) starts what follows once the HTTP port
is listening and a sampler is healthy, and Kubernetes can probe it the same way as every other
service. It reports NOT_SERVING whenever no sampler is healthy (HTTP `/health` says 503 then).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging

from gateway.app import Gateway, HttpServer, build_app
from gateway.backends import SamplerReplica
from gateway.settings import GatewaySettings
from gateway.training.trainer import AgentTrainer, start_training
from services.bus import Bus
from services.errors import ConfigError
from services.membership import Members, PeerView
from services.registry import ServiceContext, ServiceSpec
from services.server import GrpcServer
from services.waits import waiting

__all__ = ["SPEC", "announce", "main"]

log = logging.getLogger(__name__)


async def main(ctx: ServiceContext[GatewaySettings]) -> None:
    settings = ctx.settings
    # Instance names are every live replica of each (services/membership.py).
    peers = PeerView(settings.samplers, kind="sampler", resolve=ctx.resolve)
    bus = await Bus.connect(ctx.nats_url, name=f"{ctx.replica}-gateway") if ctx.nats_url else None
    members = Members(bus, ctx.run_name) if bus is not None else None
    try:
        if members is not None:
            await members.start()
            peers.follow(members)
        addresses = await waiting(
            f"a live sampler ({', '.join(settings.samplers)})",
            peers.wait(ctx.stop_event, settings.startup_timeout_s),
        )
        if addresses:
            await _serve(ctx, peers, addresses, bus)
    finally:
        if members is not None:
            await members.close()
        if bus is not None:
            with contextlib.suppress(Exception):
                await bus.close()


async def _serve(
    ctx: ServiceContext[GatewaySettings],
    peers: PeerView,
    addresses: list[str],
    bus: Bus | None,
) -> None:
    settings = ctx.settings
    gateway = Gateway.create(settings, addresses=addresses)
    health = GrpcServer(ctx.name, host=ctx.host, port=ctx.port, grace_s=1.0)
    await health.start()
    http = HttpServer(build_app(gateway, cors_origins=settings.cors_origins), settings)
    try:
        await gateway.pool.start()
        gateway.pool.follow(
            peers, lambda a: SamplerReplica(a, timeout_s=settings.request_timeout_s)
        )
        if settings.training is not None:
            gateway.training = await _start_training(ctx, gateway, bus)
        await http.start()
        freeze_heap()
        log.info(
            "gateway %s: OpenAI API on %s over samplers %s",
            ctx.name,
            http.url,
            ", ".join(addresses),
        )
        serving = None
        while not ctx.stop_event.is_set():
            now = bool(gateway.pool.healthy_backends())
            if now != serving:
                health.set_serving(now)
                serving = now
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(ctx.stop_event.wait(), settings.health_interval_s)
    finally:
        await http.stop()
        if gateway.training is not None:
            await gateway.training.close()
        await gateway.pool.close()
        await health.stop()


async def _start_training(
    ctx: ServiceContext[GatewaySettings], gateway: Gateway, bus: Bus | None
) -> AgentTrainer:
    """The training mode's bus side (settings.training)."""
    if bus is None:
        raise ConfigError("gateway: training needs the run's bus (RLFLEET_NATS_URL)")
    return await start_training(gateway, bus, ctx.run_name, ctx.name, ctx.stop_event)


def freeze_heap() -> None:
    """Move what start-up allocated (modules, FastAPI, pydantic, gRPC) out of the collector's
    reach, as vLLM's engine does: a full collection over that heap stalls every open stream;
    afterwards a full collection scans only what serving allocated."""
    gc.collect()
    gc.freeze()


def announce(settings: GatewaySettings) -> str:
    """The line `rlfleet up` prints once the gateway is healthy: the base URL an OpenAI client
    takes (loopback for a wildcard bind) and where its API key comes from."""
    host = settings.http_host
    if host in ("0.0.0.0", ""):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    host = f"[{host}]" if ":" in host else host
    port = str(settings.http_port) if settings.http_port else "<port>"
    url = f"http://{host}:{port}/v1"
    if not settings.api_keys:
        key = "none needed: no api_keys"
    else:
        sources = [
            f"${k.key_env}" if k.key_env else f"api_keys[{i}].key of the run file"
            for i, k in enumerate(settings.api_keys)
        ]
        key = " or ".join(sources)
    where = "" if settings.http_port else "; http_port 0: the port is in the gateway's log"
    return f"OpenAI API at {url} (api key: {key}{where})"


SPEC = ServiceSpec(
    kind="gateway",
    settings=GatewaySettings,
    main=main,
    announce=announce,
)
