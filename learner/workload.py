"""The contract between the learner loop (learner.loop) and a workload: the ``Workload``
protocol a workload implements, the ``RunHandle`` it is given instead of the loop, the
``Progress`` counters the loop keeps and checkpoints, and the ``Envelope`` a workload reads off
each message before it is decoded.

Implementations: ``learner.game.workload.GameWorkload`` (PPO/A2C over rollout fragments) and
``learner.lm.workload.LMWorkload`` (GRPO family over trajectory groups).
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from learner.consumer import AppliedWindow, now
from learner.engine import Engine
from learner.prometheus import export_training_metrics
from learner.tracking import NO_TRACKERS, Tracker
from rlfleet.bus.v1 import events_pb2
from services.bus import Bus, events_subject
from services.errors import RlfleetError
from services.progress import PROGRESS_EVENTS, progress_record
from services.run_layout import CHECKPOINTS_DIR, FINAL_DIR, LEARNER_DIR

__all__ = [
    "Envelope",
    "LoopSettings",
    "Progress",
    "RunDirs",
    "RunHandle",
    "ScalarWriter",
    "Workload",
]

log = logging.getLogger(__name__)

_COUNTERS = (
    "updates",
    "version",
    "samples",
    "messages",
    "stale_dropped",
    "duplicates_dropped",
    "invalid_dropped",
    "filtered_dropped",
)
# Names the counters had in checkpoints written before both workloads shared this loop.
_EARLIER_NAMES = {
    "global_step": "samples",
    "groups": "messages",
    "stale": "stale_dropped",
    "duplicates": "duplicates_dropped",
    "invalid": "invalid_dropped",
    "filtered": "filtered_dropped",
}


@dataclass
class Progress:
    """The run's counters (what GetStatus reports), carried across restarts in every checkpoint."""

    updates: int = 0
    version: int = 0  # latest published policy version
    samples: int = 0  # training samples applied: env transitions (game) or completions (LM)
    messages: int = 0  # bus messages applied: rollout fragments or trajectory groups
    stale_dropped: int = 0
    duplicates_dropped: int = 0
    invalid_dropped: int = 0
    filtered_dropped: int = 0  # decoded, but without training signal (e.g. dynamic sampling)
    applied: AppliedWindow = field(default_factory=lambda: AppliedWindow(100_000))

    def count_drop(self, status: str) -> None:
        """One more message dropped as ``status``: "stale", "invalid" or "filtered"."""
        name = f"{status}_dropped"
        setattr(self, name, getattr(self, name) + 1)

    def to_state(self) -> dict[str, Any]:
        state: dict[str, Any] = {name: getattr(self, name) for name in _COUNTERS}
        state.update(applied=self.applied.to_list(), applied_max=self.applied.maxlen)
        return state

    @classmethod
    def from_state(cls, state: dict[str, Any], window: int) -> Progress:
        earlier = {new: state[old] for old, new in _EARLIER_NAMES.items() if old in state}
        merged = {**earlier, **state}
        counters: dict[str, Any] = {name: int(merged.get(name, 0)) for name in _COUNTERS}
        progress = cls(**counters)
        progress.applied = AppliedWindow(window, state.get("applied", ()))
        return progress


@dataclass(frozen=True)
class Envelope:
    """What the loop reads off a message before decoding it: enough to triage and ledger it."""

    id: str
    policy_version: int  # the oldest policy that produced it: its lag is judged on this
    fields: dict[str, Any] = field(default_factory=dict)  # more for its ledger lines
    # For flow control (learner.consumer.TakenSequences): who produced it and its position
    # among that producer's messages; None where the workload's producers do not pace on it.
    producer: str | None = None
    sequence: int = -1


@dataclass(frozen=True)
class RunDirs:
    """The learner's folders in a run directory; every rank reads the same ones."""

    checkpoints: Path
    learner: Path  # the ledger, state.json, rank digests, the LM's eval.jsonl
    final: Path  # what a finished (or stopped game) run leaves to play or export
    tensorboard: Path

    @classmethod
    def of(cls, run_dir: Path) -> RunDirs:
        return cls(
            checkpoints=run_dir / CHECKPOINTS_DIR,
            learner=run_dir / LEARNER_DIR,
            final=run_dir / FINAL_DIR,
            tensorboard=run_dir / "tensorboard",
        )


class ScalarWriter(Protocol):
    """The part of TensorBoard's SummaryWriter the run writes through."""

    def add_scalar(self, tag: str, scalar_value: float, global_step: int) -> None: ...


@dataclass(frozen=True)
class RunHandle:
    """What a workload sees of the run the loop drives: the counters, the bus, the folders and
    where scalars and progress go (TensorBoard, and the experiment trackers the run file turns
    on, learner.tracking). The loop builds it once the bus is up; the ledger, the acks and the
    versions stay out of a workload's reach, so it cannot break their guarantees."""

    run_name: str
    source: str  # the learner service's name, on every event it publishes
    progress: Progress  # the loop's counters: read them, the loop alone changes them
    bus: Bus
    dirs: RunDirs
    writer: ScalarWriter
    tensorboard_step: Callable[[Progress], int]  # the workload's x axis (``Workload.step``)
    trackers: Tracker = NO_TRACKERS  # W&B, MLflow: they queue, never block (learner.tracking)

    def write_scalars(self, metrics: Mapping[str, float], step: int) -> None:
        """To TensorBoard and the trackers, the finite ones, at ``step``."""
        finite = {key: value for key, value in metrics.items() if math.isfinite(value)}
        for key, value in finite.items():
            self.writer.add_scalar(key, value, step)
        self.trackers.log_scalars(finite, step)

    async def report(self, metrics: Mapping[str, float]) -> None:
        """Log ``metrics`` at the current point: TensorBoard and the trackers (finite ones),
        Prometheus (the gauges learner.prometheus maps), the bus (Metrics, NaN/inf included:
        metrics.jsonl keeps them visible) and the log."""
        p = self.progress
        values = {k: float(v) for k, v in metrics.items()}
        self.write_scalars(values, self.tensorboard_step(p))
        export_training_metrics(self.run_name, values, updates=p.updates, version=p.version)
        message = events_pb2.Metrics(
            run=self.run_name,
            source=self.source,
            step=p.updates,
            time=now(),
            scalars=values,
            policy_version=p.version,
        )
        with contextlib.suppress(RlfleetError):  # metrics are best effort
            await self.bus.publish_event(events_subject(self.run_name, "metrics"), message)
        log.info(
            "update %d v%d (%d samples): %s",
            p.updates,
            p.version,
            p.samples,
            " ".join(f"{k}={v:.4g}" for k, v in sorted(values.items())),
        )

    async def publish_progress(
        self,
        unit: str,
        done: int,
        total: int,
        headline: Sequence[tuple[str, str]],
        values: Mapping[str, float],
    ) -> None:
        """The record behind `rlfleet up`'s progress line: ``done`` of ``total`` ``unit``s and
        the ``headline`` (label, metric key) pairs found in ``values``. Best effort."""
        record = progress_record(
            self.source,
            unit=unit,
            done=done,
            total=total,
            version=self.progress.version,
            headline=[(label, values[key]) for label, key in headline if key in values],
        )
        with contextlib.suppress(RlfleetError):  # best effort, like the metrics
            await self.bus.publish_event(events_subject(self.run_name, PROGRESS_EVENTS), record)


class LoopSettings(Protocol):
    """The settings every workload's settings carry for the loop."""

    @property
    def max_policy_lag(self) -> int: ...
    @property
    def checkpoint_every(self) -> int: ...
    @property
    def keep_checkpoints(self) -> int: ...
    @property
    def keep_versions(self) -> int: ...
    @property
    def ack_wait_s(self) -> float: ...
    @property
    def applied_window(self) -> int: ...
    @property
    def seed(self) -> int: ...
    @property
    def max_ack_pending(self) -> int: ...
    @property
    def max_nonfinite_updates(self) -> int: ...


class Workload(Protocol):
    """What one kind of training data and model adds to the loop. Methods documented as
    blocking run in a thread; the others on the event loop."""

    durable: str  # the JetStream consumer's name
    messages_per_update: int
    noun: str  # what a message is called in log lines ("fragments", "groups")
    # True: SERVING as soon as the WeightService is up, so clients start their engines during a
    # long warm start and wait for version 0; False: SERVING once version 0 is published.
    serve_before_first_version: bool

    @property
    def settings(self) -> LoopSettings: ...

    @property
    def message_type(self) -> type:
        """What the run's trajectory stream carries (a protobuf message class)."""

    async def setup(self) -> None:
        """What the model needs that must be awaited (e.g. env spaces from an env server)."""

    def build(self) -> Engine:
        """Blocking: the model on its engine. The loop seeds every RNG first and restores the
        latest checkpoint after."""

    def restore(self, state: dict[str, Any]) -> None:
        """Take back the workload's part of a restored checkpoint (see ``state``)."""

    def state(self) -> dict[str, Any]:
        """The workload's part of a checkpoint, beside the loop's ``Progress``."""

    def warm_start(self, run: RunHandle) -> None:
        """Blocking: training before version 0 is published (e.g. SFT); may do nothing."""

    def weights(self) -> dict[str, torch.Tensor]:
        """Blocking: the named tensors a version publishes."""

    async def begin(self, run: RunHandle) -> None:
        """Version 0 is out and nothing consumed yet (e.g. evaluate the baseline)."""

    def envelope(self, message: Any) -> Envelope:
        """Id, policy version and ledger fields of a message (never raises)."""

    async def decode(self, message: Any) -> Any:
        """The message checked and decoded; raises InvalidArgument naming the bad field. Async:
        decoding may fetch what the message names by reference (a prompt's images)."""

    def accept(self, decoded: Any) -> tuple[list[Any], str | None]:
        """The items of a decoded message to train on, or ([], why it is filtered out)."""

    def samples(self, items: list[Any]) -> int:
        """How many training samples ``items`` are (``Progress.samples``)."""

    def train(
        self, items: list[Any], progress: Progress, generator: torch.Generator
    ) -> dict[str, float]:
        """Blocking: one update on ``items`` (``progress`` is still the one before it)."""

    def report(
        self, items: list[Any], metrics: dict[str, float], progress: Progress, elapsed_s: float
    ) -> dict[str, float]:
        """Run-level metrics to log with the update's (``elapsed_s`` since consuming began)."""

    def step(self, progress: Progress) -> int:
        """The TensorBoard step of the current point."""

    async def after_update(self, run: RunHandle, metrics: Mapping[str, float]) -> None:
        """After each update is published and reported with ``metrics`` (e.g. a periodic
        evaluation, the progress record)."""

    def done(self, progress: Progress) -> bool:
        """The run is over."""

    async def finish(self, run: RunHandle) -> None:
        """Before the final save (e.g. the final evaluation)."""

    def save_final(self, final_dir: Path, progress: Progress) -> None:
        """Blocking: what a finished run leaves in ``final/``."""

    def summary(self, progress: Progress) -> str:
        """The DONE RunStatus message."""

    async def close(self) -> None:
        """Stop what ``begin`` started."""
