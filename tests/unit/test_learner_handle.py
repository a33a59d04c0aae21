"""learner.workload.RunHandle, what a workload sees of the run: reports go to TensorBoard (finite
values, at the workload's step) and to the bus (Metrics, NaN/inf included, and progress records)
best effort, and the folders are the run directory's."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from google.protobuf import json_format

from learner.workload import Progress, RunDirs, RunHandle
from rlfleet.bus.v1 import events_pb2
from services.errors import Unavailable


class Writer:
    def __init__(self) -> None:
        self.scalars: list[tuple[str, float, int]] = []

    def add_scalar(self, tag: str, scalar_value: float, global_step: int) -> None:
        self.scalars.append((tag, scalar_value, global_step))


class Bus:
    def __init__(self, fail: bool = False) -> None:
        self.events: list[tuple[str, Any]] = []
        self.fail = fail

    async def publish_event(self, subject: str, message: Any) -> None:
        if self.fail:
            raise Unavailable("the bus is gone")
        self.events.append((subject, message))


def handle(tmp_path: Path, bus: Bus, writer: Writer) -> RunHandle:
    progress = Progress(updates=3, version=4, samples=96)
    return RunHandle(
        run_name="r",
        source="learner",
        progress=progress,
        bus=bus,  # type: ignore[arg-type]
        dirs=RunDirs.of(tmp_path),
        writer=writer,
        tensorboard_step=lambda p: p.samples,
    )


async def test_report_writes_finite_scalars_at_the_workloads_step_and_publishes_all_metrics(
    tmp_path: Path,
) -> None:
    bus, writer = Bus(), Writer()
    run = handle(tmp_path, bus, writer)
    await run.report({"losses/loss": 0.5, "charts/nan": float("nan")})
    assert writer.scalars == [("losses/loss", 0.5, 96)]
    [(subject, message)] = bus.events
    assert subject == "rlfleet.v1.events.r.metrics"
    assert isinstance(message, events_pb2.Metrics)
    assert (message.step, message.policy_version, message.source) == (3, 4, "learner")
    # A NaN loss is news, not noise: it goes out (metrics.jsonl writes it as null, flagged).
    assert message.scalars["losses/loss"] == 0.5 and math.isnan(message.scalars["charts/nan"])


async def test_progress_record_names_the_headline_values_found(tmp_path: Path) -> None:
    bus = Bus()
    run = handle(tmp_path, bus, Writer())
    headline = (("reward", "reward/total"), ("eval", "eval/accuracy"))
    await run.publish_progress("update", 3, 10, headline, {"reward/total": 0.25})
    [(subject, record)] = bus.events
    assert subject == "rlfleet.v1.events.r.progress"
    fields = json_format.MessageToDict(record)
    assert (fields["unit"], fields["done"], fields["total"], fields["version"]) == (
        "update", 3, 10, 4,
    )  # fmt: skip
    assert fields["headline"] == [["reward", 0.25]]


async def test_reports_are_best_effort_when_the_bus_fails(tmp_path: Path) -> None:
    writer = Writer()
    run = handle(tmp_path, Bus(fail=True), writer)
    await run.report({"losses/loss": 1.0})
    await run.publish_progress("step", 1, 2, (), {})
    assert writer.scalars == [("losses/loss", 1.0, 96)]  # TensorBoard still has it


def test_run_dirs_are_the_run_directorys_folders(tmp_path: Path) -> None:
    dirs = RunDirs.of(tmp_path)
    assert (dirs.checkpoints, dirs.learner, dirs.final, dirs.tensorboard) == (
        tmp_path / "checkpoints", tmp_path / "learner", tmp_path / "final",
        tmp_path / "tensorboard",
    )  # fmt: skip
