"""The `game_actor` service kind: a batched actor over remote environments (sampler/actors/actor.py)
that steps env servers with the current policy and publishes rollout fragments to the run."""

from __future__ import annotations

from sampler.actors.actor import GameActor
from sampler.actors.settings import GameActorSettings
from services.registry import ServiceContext, ServiceSpec

__all__ = ["SPEC", "main"]


def needs(settings: GameActorSettings) -> tuple[str, ...]:
    """What `rlfleet up` starts first (services/start_order.py): the env servers the actor
    names, whose sessions it opens first thing. Not the learner: the actor waits for the first
    weights itself (WeightFollower.first), so it imports torch and opens its envs while the
    learner loads instead of after."""
    return tuple(dict.fromkeys(ref for ref in settings.env_servers if ":" not in ref))


async def main(ctx: ServiceContext[GameActorSettings]) -> None:
    """Run the actor until done or stopped (the launcher's `main` service when it is the demo)."""
    await GameActor(ctx, ctx.settings).run()


SPEC = ServiceSpec(
    kind="game_actor", settings=GameActorSettings, main=main, grpc=False, needs=needs
)
