"""The `lm_learner` service kind: trajectory groups in from JetStream, GRPO-family updates of a
transformers causal LM on a DeepSpeed engine, Hugging Face-named weight versions out.

Same run and delivery guarantees as the game learner: both are learner.loop's (a group is acked
only once a checkpoint covers the update that applied it; stale, duplicate, malformed and
filtered groups are ledgered). What is particular to LM RL is learner.lm.workload's.
"""

from __future__ import annotations

from learner.lm.settings import LMLearnerSettings
from services.registry import ServiceContext, ServiceSpec
from services.start_order import named_services

__all__ = ["SPEC", "main"]


async def main(ctx: ServiceContext[LMLearnerSettings]) -> None:
    """Train for total_updates updates (exit 0) or until the service is stopped."""
    # Imported here, not at the top: `rlfleet up` reads this module's SPEC and needs no torch.
    from learner.lm.workload import LMWorkload
    from learner.loop import LearnerLoop

    settings = ctx.settings
    await LearnerLoop(ctx, LMWorkload(ctx, settings)).run()


def preload(settings: LMLearnerSettings) -> None:
    """What main imports: torch, transformers' causal LMs and DeepSpeed."""
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: F401

    from learner.engine import preload_engine
    from learner.lm.workload import engine_settings

    preload_engine(engine_settings(settings))


# Needs its reward service up: the evaluation of version 0, at once without an SFT warm start,
# scores through it without waiting for it. Nothing else: the samplers fetch its weights.
SPEC = ServiceSpec(
    kind="lm_learner",
    settings=LMLearnerSettings,
    main=main,
    grpc=True,
    needs=named_services,
    preload=preload,
)
