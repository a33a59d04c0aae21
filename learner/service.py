"""The `learner` service kind (game RL): fragments in from JetStream, PPO/A2C updates on a
DeepSpeed engine, weight versions out through WeightService and the bus.

The run itself (consumer, ledger, checkpoint-then-ack, versions, GetStatus) is learner.loop's;
what is particular to game RL is learner.game_workload's, and the math learner.game's.
"""

from __future__ import annotations

from learner.game_workload import GameWorkload
from learner.loop import LearnerLoop
from learner.settings import LearnerSettings
from services.registry import ServiceContext, ServiceSpec

__all__ = ["SPEC", "main"]


async def main(ctx: ServiceContext[LearnerSettings]) -> None:
    """Train until total_timesteps env steps are consumed (exit 0) or the service is stopped."""
    settings = ctx.settings
    await LearnerLoop(ctx, GameWorkload(ctx, settings)).run()


SPEC = ServiceSpec(kind="learner", settings=LearnerSettings, main=main, grpc=True)
