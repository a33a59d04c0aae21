"""The `learner` service kind (game RL): fragments in from JetStream, PPO/A2C updates on a
DeepSpeed engine, weight versions out through WeightService and the bus.

The run itself (consumer, ledger, checkpoint-then-ack, versions, GetStatus) is learner.loop's;
what is particular to game RL is learner.game.workload's, and the math learner.game's. With
several ranks (``ranks: N`` or under torchrun) rank 0 runs the loop and the others follow it
(learner.ranks).
"""

from __future__ import annotations

from learner.game.settings import LearnerSettings
from services.registry import ServiceContext, ServiceSpec

__all__ = ["SPEC", "main"]


async def main(ctx: ServiceContext[LearnerSettings]) -> None:
    """Train until total_timesteps env steps are consumed (exit 0) or the service is stopped."""
    # Imported here, not at the top: `rlfleet up` reads this module's SPEC and needs no torch.
    from learner.game.workload import GameWorkload
    from learner.loop import LearnerLoop
    from learner.ranks import Ranks, follow

    settings = ctx.settings
    workload = GameWorkload(ctx, settings)
    ranks = Ranks.start(settings)  # None: one process
    if ranks is not None and ranks.rank > 0:
        await follow(ctx, workload, ranks)
        return
    await LearnerLoop(ctx, workload, ranks).run()


def preload(settings: LearnerSettings) -> None:
    """What main imports: torch, the workload and DeepSpeed (its engine's modules)."""
    from learner.engine import preload_engine
    from learner.game.workload import engine_settings
    from learner.ranks import Ranks  # noqa: F401

    preload_engine(engine_settings(settings))


SPEC = ServiceSpec(
    kind="learner",
    settings=LearnerSettings,
    main=main,
    grpc=True,
    preload=preload,
)
