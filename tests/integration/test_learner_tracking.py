"""A real `rlfleet serve learner` whose run file turns on W&B (offline) and MLflow (file store):
after real updates to the end of the run, both hold the TensorBoard scalars under the same
names and steps, the run config, and the final policy; wandb's service process ended with the
learner."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import yaml

from services.bus import Bus, stream_name, traj_subject
from services.ports import free_port
from tests.integration.test_learner_service import (
    Watcher,
    fragment,
    learner_run,
    start_learner,
    until,
)
from tests.unit.test_tracking import _key, wandb_records

pytestmark = [
    pytest.mark.slow,  # a DeepSpeed learner service
    pytest.mark.timeout(300),
    pytest.mark.asyncio(loop_scope="session"),
]

FRAGMENTS = 4  # 2 updates of 2, then the run is over


def tensorboard_points(folder: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder))
    events.Reload()
    return {
        tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]
    }


def wandb_core_of(pid: int) -> list[str]:
    """Command lines of wandb service processes started for the process ``pid``."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().split(b"\0")
        except OSError:
            continue
        if any(b"wandb-core" in a for a in args) and str(pid).encode() in args:
            found.append(b" ".join(args).decode(errors="replace"))
    return found


async def test_learner_logs_to_wandb_and_mlflow_as_to_tensorboard(
    nats_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, folder in (("CONFIG", "config"), ("CACHE", "cache"), ("DATA", "data")):
        monkeypatch.setenv(f"WANDB_{name}_DIR", str(tmp_path / "wandb-home" / folder))
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")  # no network: it would fail
    monkeypatch.delenv("WANDB_MODE", raising=False)
    run, run_dir, config = learner_run(tmp_path, "itest-track", FRAGMENTS)
    data = yaml.safe_load(config.read_text())
    data["run"]["tracking"] = {"wandb": {"tags": ["itest"]}, "mlflow": True}
    config.write_text(yaml.safe_dump(data))

    watcher = Watcher()
    async with Bus.connect(nats_url, name="test-learner-tracking") as bus:
        await bus.ensure_stream(stream_name(run), [traj_subject(run)])
        tasks = await watcher.watch(bus, run)
        learner = await start_learner(config, run, run_dir, nats_url, free_port())
        try:
            await until(lambda: watcher.weights)  # version 0 is out: the learner is ready
            for seq in range(FRAGMENTS):
                await bus.publish(traj_subject(run), fragment(run, seq, 0), msg_id=f"{run}/{seq}")
            assert await asyncio.wait_for(learner.wait(), 240) == 0
        finally:
            if learner.returncode is None:
                learner.kill()
                await learner.wait()
            for task in tasks:
                task.cancel()
    assert not wandb_core_of(learner.pid)

    board = tensorboard_points(run_dir / "tensorboard")
    assert {"charts/SPS", "losses/approx_kl", "charts/policy_lag"} <= set(board)
    assert [step for step, _ in board["charts/SPS"]] == [2 * 32, 4 * 32]  # env steps

    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # a reader of a file store opts in too
    ids = json.loads((run_dir / "learner/tracking.json").read_text())
    client = MlflowClient((run_dir / "mlruns").as_uri())
    finished = client.get_run(ids["mlflow"])
    assert (finished.info.status, finished.info.run_name) == ("FINISHED", run)
    for tag, points in board.items():
        history = client.get_metric_history(ids["mlflow"], tag)
        assert [(m.step, pytest.approx(m.value)) for m in history] == points, tag
    assert finished.data.params["services.learner.settings.total_timesteps"] == "128"
    files = sorted(a.path for a in client.list_artifacts(ids["mlflow"], "final"))
    assert files == ["final/policy.json", "final/policy.pt"]

    [wandb_file] = (run_dir / "wandb").glob(f"offline-run-*/run-{ids['wandb']}.wandb")
    records = list(wandb_records(wandb_file))
    rows = [
        {_key(item): json.loads(item.value_json) for item in r.history.item}
        for r in records
        if r.HasField("history")
    ]
    for tag, points in board.items():
        logged = [(row["global_step"], row[tag]) for row in rows if tag in row]
        assert logged == [(s, pytest.approx(v)) for s, v in points], tag
    [artifact] = [r.artifact for r in records if r.HasField("artifact")]
    assert sorted(e.path for e in artifact.manifest.contents) == ["policy.json", "policy.pt"]
