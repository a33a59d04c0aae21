"""The `rollout` service kind: a rollout driver for language-model RL (GRPO family, CHORD).

Runs until stopped (SIGTERM/SIGINT) or until the run's status says it is over; it serves no
gRPC of its own. See driver.py for the loop, prompts.py for the prompt queue (and why exactly
one driver feeds it), pacing.py for how far it runs ahead of the learner.
"""

from __future__ import annotations

from sampler.rollout.driver import RolloutDriver
from sampler.rollout.settings import RolloutSettings
from services.registry import ServiceContext, ServiceSpec
from services.start_order import needs_nothing

__all__ = ["SPEC", "main"]


async def main(ctx: ServiceContext[RolloutSettings]) -> None:
    settings = ctx.settings
    await RolloutDriver(ctx, settings).run()


# Starts at once: the driver waits for each sampler and its reward service to report healthy
# (RolloutDriver, startup_timeout_s), so its own start overlaps theirs.
SPEC = ServiceSpec(
    kind="rollout",
    settings=RolloutSettings,
    main=main,
    grpc=False,
    needs=needs_nothing,
    produces=lambda s: "trajectory groups",
)
