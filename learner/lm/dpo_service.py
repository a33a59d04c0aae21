"""The `dpo_learner` service kind: offline DPO (learner/lm/dpo.py) as a run's main service, what a
run file's ``job: {kind: dpo}`` expands into (learner/lm/dpo_job.py).

It trains in a thread on the run directory (``checkpoints/``, ``tensorboard/``, ``final/``; and
the run file's trackers, ``run.tracking``: learner/tracking.py) and
tells the run what it does through the bus, as every learner does: start-up phases and the
resume as RunStatus messages, a progress record (steps done of the total, loss, reward
accuracy and margin) and a Metrics event every ``log_every`` steps (``metrics.jsonl``), and a
RunStatus DONE with the summary at the end. SIGTERM stops it between two steps, checkpointed;
started again it resumes after the latest checkpoint.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import math

from google.protobuf import timestamp_pb2

from learner.lm.dpo_job import DPOSettings
from learner.lm.phases import Announcer
from learner.prometheus import export_training_metrics
from rlfleet.bus.v1 import events_pb2
from services.errors import ConfigError
from services.registry import ServiceContext, ServiceSpec

__all__ = ["SPEC", "BusReporter", "main"]

log = logging.getLogger(__name__)

# The progress line's values (services.progress): (label, metric key) in display order.
HEADLINE = (
    ("loss", "loss"),
    ("acc", "rewards/accuracies"),
    ("margin", "rewards/margins"),
    ("eval_acc", "eval/rewards/accuracies"),
    ("tok/s", "tokens/s"),
)


class BusReporter:
    """The trainer's Reporter (learner.lm.dpo) for a service, called from the training thread:
    phases, progress records and Metrics through an ``Announcer`` (learner/lm/phases.py)."""

    def __init__(self, announcer: Announcer) -> None:
        self.announcer = announcer
        self.ctx = announcer.ctx
        self.last: dict[str, float] = {}  # eval values stay on the line once measured

    def status(self, message: str, *, running: bool = False) -> None:
        self.announcer.say(message, running=running)

    def progress(self, step: int, total: int, row: dict[str, float]) -> None:
        finite = {k: float(v) for k, v in row.items() if math.isfinite(v)}
        self.last.update(finite)
        values = self.last
        headline = [(label, values[key]) for label, key in HEADLINE if key in values]
        self.announcer.count("step", step, total, headline)
        export_training_metrics(self.ctx.run_name, finite, updates=step)
        stamp = timestamp_pb2.Timestamp()
        stamp.GetCurrentTime()
        metrics = events_pb2.Metrics(
            run=self.ctx.run_name, source=self.ctx.name, step=step, time=stamp, scalars=finite
        )
        self.announcer.publish("metrics", metrics)  # this step's own values: metrics.jsonl

    def stopping(self) -> bool:
        return self.ctx.stop_event.is_set()


async def main(ctx: ServiceContext[DPOSettings]) -> None:
    """Train to the end (exit 0, RunStatus DONE) or until stopped (checkpointed)."""
    announcer = await Announcer(ctx).open()
    try:
        # Importing torch, transformers and DeepSpeed is slow on a busy CPU: say so, and import
        # in a thread so that the event loop sends the notice meanwhile.
        announcer.say("importing torch, transformers and DeepSpeed")
        await asyncio.to_thread(importlib.import_module, "learner.lm.dpo")
        from common.datasets import DatasetSpecError
        from learner.lm.dpo import train
        from learner.tracking import trackers_of

        try:
            result = await asyncio.to_thread(
                train, ctx.settings, ctx.run_dir, BusReporter(announcer), trackers_of(ctx)
            )
        except DatasetSpecError as exc:  # a bad pair file: a configuration error, not a crash
            raise ConfigError(str(exc)) from None
        log.info("dpo: %s (%.1f s)", result.summary(), result.seconds)
        if not result.stopped:
            announcer.say(result.summary(), state=events_pb2.RUN_STATE_DONE)
    finally:
        await announcer.close()


SPEC = ServiceSpec(kind="dpo_learner", settings=DPOSettings, main=main, grpc=False)
