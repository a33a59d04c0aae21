"""The `game_actor` service kind: a batched actor over remote environments (sampler/actors/actor.py)
that steps env servers with the current policy and publishes rollout fragments to the run."""

from __future__ import annotations

from sampler.actors.actor import GameActor
from sampler.actors.settings import GameActorSettings
from services.registry import ServiceContext, ServiceSpec

__all__ = ["SPEC", "main"]


async def main(ctx: ServiceContext[GameActorSettings]) -> None:
    """Run the actor until done or stopped (the launcher's `main` service when it is the demo)."""
    await GameActor(ctx, ctx.settings).run()


def _preload(settings: GameActorSettings) -> None:
    """The learner's policy runs on torch (imported as the policy is built)."""
    if settings.policy == "learner":
        import common.policies  # noqa: F401  (and torch)


SPEC = ServiceSpec(
    kind="game_actor",
    settings=GameActorSettings,
    main=main,
    grpc=False,
    preload=_preload,
    produces=lambda s: "rollout fragments" if s.publishes else None,
)
