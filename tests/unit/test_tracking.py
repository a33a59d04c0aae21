"""Experiment trackers (learner/tracking.py, settings in services/tracking.py), with the real
libraries and no network: W&B offline and an MLflow file store record the scalars under
TensorBoard's names and steps, the resolved run config, and the final policy, read back with
the libraries' own formats; a failing or stuck tracker costs the training nothing; the
settings are validated like every run-file key; wandb's service process ends with the run."""

from __future__ import annotations

import json
import logging
import os
import struct
import textwrap
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from learner.tracking import (
    STEP_METRIC,
    TRACKERS,
    TrackedRun,
    Trackers,
    flat_params,
    open_trackers,
    resolved_config,
)
from learner.workload import Progress, RunDirs, RunHandle
from services.builtin import HeartbeatSettings
from services.config import load_run_config, read_run_config
from services.errors import ConfigError
from services.tracking import MlflowSettings, TrackingSection, WandbSettings

RUN_FILE = """\
run:
  name: demo
  tracking:
    wandb: {mode: offline, project: tests, tags: [unit]}
    mlflow: true
nats: {url: "nats://user:secret@127.0.0.1:4222"}
services:
  - name: hb
    service: heartbeat
    main: true
    settings: {interval_s: 0.5}
"""
# What the game learner reports, at its step (env steps), and once more at the end.
POINTS = [
    ({"charts/episodic_return": 21.0, "charts/SPS": 900.0, "losses/approx_kl": 0.01}, 256),
    ({"charts/episodic_return": 48.5, "charts/SPS": 950.0, "losses/approx_kl": 0.02}, 512),
    ({"charts/episodic_return": 97.0}, 768),
]


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """W&B's home folders in the test's, its server address unreachable (an attempt to use the
    network would fail, not pass unseen), and MLflow's file-store opt-in unset, as a user has
    it (the tracker sets it; monkeypatch takes it back)."""
    for name, folder in (("CONFIG", "config"), ("CACHE", "cache"), ("DATA", "data")):
        monkeypatch.setenv(f"WANDB_{name}_DIR", str(tmp_path / "wandb-home" / folder))
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")
    for name in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_SILENT", "MLFLOW_ALLOW_FILE_STORE"):
        monkeypatch.delenv(name, raising=False)


def tracked_run(tmp_path: Path) -> TrackedRun:
    path = tmp_path / "run.yaml"
    path.write_text(RUN_FILE)
    config = read_run_config(path)
    record = resolved_config(config, "hb", HeartbeatSettings(interval_s=0.5))
    return TrackedRun(name="demo", run_dir=tmp_path / "runs" / "demo", config=record)


def final_dir(tmp_path: Path) -> Path:
    final = tmp_path / "runs" / "demo" / "final"
    final.mkdir(parents=True)
    (final / "policy.pt").write_bytes(b"\0" * 64)
    (final / "policy.json").write_text('{"env_id": "CartPole-v1"}')
    return final


def run_all(trackers: Trackers, final: Path | None) -> None:
    for values, step in POINTS:
        trackers.log_scalars(values, step)
    if final is not None:
        trackers.log_final(final)
    trackers.close()


def wandb_children() -> list[str]:
    """The names of this process's children that are wandb's (its service, wandb-core),
    zombies included: a process ended but not waited for is left over too."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:  # ended meanwhile
            continue
        name = text[text.index("(") + 1 : text.rindex(")")]
        parent = int(text[text.rindex(")") + 2 :].split()[1])
        if parent == os.getpid() and "wandb" in name:
            found.append(name)
    return found


# ------------------------------------------------------------------ MLflow


def test_mlflow_file_store_holds_params_metrics_and_the_final_policy(
    offline: None, tmp_path: Path
) -> None:
    from mlflow.tracking import MlflowClient

    run = tracked_run(tmp_path)
    run_all(open_trackers(TrackingSection(mlflow=MlflowSettings()), run), final_dir(tmp_path))

    client = MlflowClient(tracking_uri=(run.run_dir / "mlruns").as_uri())  # the default store
    experiment = client.get_experiment_by_name("demo")
    assert experiment is not None
    [found] = client.search_runs([experiment.experiment_id])
    run_id = found.info.run_id
    assert (found.info.run_name, found.info.status) == ("demo", "FINISHED")
    assert json.loads((run.run_dir / "learner/tracking.json").read_text()) == {"mlflow": run_id}
    history = {
        key: [(m.step, m.value) for m in client.get_metric_history(run_id, key)]
        for key in ("charts/episodic_return", "charts/SPS", "losses/approx_kl")
    }
    assert history == {
        "charts/episodic_return": [(256, 21.0), (512, 48.5), (768, 97.0)],
        "charts/SPS": [(256, 900.0), (512, 950.0)],
        "losses/approx_kl": [(256, 0.01), (512, 0.02)],
    }
    params = found.data.params
    assert params["run.name"] == "demo"
    assert params["services.hb.service"] == "heartbeat"
    assert params["services.hb.settings.interval_s"] == "0.5"
    assert params["services.hb.settings.exit_after_s"] == "null"  # the default, filled in
    assert params["run.tracking.wandb.tags"] == '["unit"]'
    assert params["nats.url"] == "nats://127.0.0.1:4222"  # no password
    assert [a.path for a in client.list_artifacts(run_id)] == ["final"]
    assert sorted(a.path for a in client.list_artifacts(run_id, "final")) == [
        "final/policy.json",
        "final/policy.pt",
    ]


def test_a_restarted_learner_continues_the_same_mlflow_run(offline: None, tmp_path: Path) -> None:
    from mlflow.tracking import MlflowClient

    run, section = tracked_run(tmp_path), TrackingSection(mlflow=MlflowSettings())
    first = open_trackers(section, run)
    first.log_scalars({"losses/loss": 1.0}, 1)
    first.close()  # stopped before the end
    uri = (run.run_dir / "mlruns").as_uri()
    run_id = run.remembered_id("mlflow")
    assert run_id is not None and MlflowClient(uri).get_run(run_id).info.status == "KILLED"
    again = open_trackers(section, run)
    again.log_scalars({"losses/loss": 0.5}, 2)
    again.close()
    client = MlflowClient(uri)
    history = client.get_metric_history(run_id, "losses/loss")
    assert [(m.step, m.value) for m in history] == [(1, 1.0), (2, 0.5)]
    experiment = client.get_experiment_by_name("demo")
    assert experiment is not None and len(client.search_runs([experiment.experiment_id])) == 1


# ------------------------------------------------------------------ Weights & Biases


def wandb_records(path: Path) -> Iterator[Any]:
    """The records of a ``.wandb`` file. wandb's Python reader of it went with its Go core
    (wandb.sdk.internal.datastore); the file is a W&B header (":W&B", magic, version: 7 bytes)
    then LevelDB's log format: 32 KiB blocks of chunks, each crc32 (4 bytes), length (2), type
    (1: full, 2: first, 3: middle, 4: last; 0: padding to the block's end), each whole record
    a serialized wandb_internal.Record."""
    from wandb.proto import wandb_internal_pb2

    block, data = 32 * 1024, path.read_bytes()
    assert data[:4] == b":W&B"
    pos, parts = 7, []
    while pos + 7 <= len(data):
        room = block - pos % block
        if room < 7:
            pos += room
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0:
            pos += room
            continue
        parts.append(data[pos + 7 : pos + 7 + length])
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(b"".join(parts))
            parts = []
            yield record


def _key(item: Any) -> str:
    """A history item's name: wandb writes it as its path of nested keys."""
    return item.key or "/".join(item.nested_key)


def test_wandb_offline_run_holds_scalars_config_and_the_final_policy(
    offline: None, tmp_path: Path
) -> None:
    run, final = tracked_run(tmp_path), final_dir(tmp_path)
    settings = WandbSettings(project="tests", tags=["unit"])
    trackers = open_trackers(TrackingSection(wandb=settings), run)
    deadline = time.monotonic() + 60
    while not wandb_children():  # the worker has started wandb's service
        assert time.monotonic() < deadline, "wandb-core never started"
        time.sleep(0.05)
    run_all(trackers, final)
    assert not wandb_children()  # ... and it ended with the tracker

    run_id = run.remembered_id("wandb")
    [folder] = (run.run_dir / "wandb").glob(f"offline-run-*-{run_id}")
    records = list(wandb_records(folder / f"run-{run_id}.wandb"))
    [header] = [r.run for r in records if r.HasField("run")]
    assert (header.run_id, header.display_name, header.project) == (run_id, "demo", "tests")
    assert list(header.tags) == ["unit"]
    config = {item.key: json.loads(item.value_json) for item in header.config.update}
    assert config["run"]["name"] == "demo" and config["services"]["hb"]["service"] == "heartbeat"
    assert config["nats"]["url"] == "nats://127.0.0.1:4222"

    rows = [
        {_key(item): json.loads(item.value_json) for item in r.history.item}
        for r in records
        if r.HasField("history")
    ]
    logged = [
        (
            {k: v for k, v in row.items() if not k.startswith("_") and k != STEP_METRIC},
            row[STEP_METRIC],
        )
        for row in rows
    ]
    assert logged == POINTS  # TensorBoard's names, at TensorBoard's steps
    steps = [r.metric for r in records if r.HasField("metric")]
    assert any(m.glob_name == "*" and m.step_metric == STEP_METRIC for m in steps)

    [artifact] = [r.artifact for r in records if r.HasField("artifact")]
    assert (artifact.name, artifact.type) == ("demo-final", "model")
    assert "final" in artifact.aliases
    manifest = {entry.path: entry for entry in artifact.manifest.contents}
    assert sorted(manifest) == ["policy.json", "policy.pt"]
    assert manifest["policy.pt"].size == 64
    # Referenced where it is (policy "immutable"), not copied to wandb's staging folder.
    assert Path(manifest["policy.pt"].local_path) == final / "policy.pt"
    assert not (tmp_path / "wandb-home" / "data" / "artifacts").exists()


def test_a_wandb_that_cannot_start_is_off_with_one_warning_and_leaves_no_process(
    offline: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # no ~/.netrc holding a key
    monkeypatch.setenv("NETRC", str(tmp_path / "home" / ".netrc"))
    trackers = open_trackers(
        TrackingSection(wandb=WandbSettings(mode="online")), tracked_run(tmp_path)
    )
    with caplog.at_level(logging.WARNING, logger="learner.tracking"):
        run_all(trackers, None)
    [warning] = [r.getMessage() for r in caplog.records]
    assert warning.startswith("wandb: could not start, tracking it is off: UsageError: No API key")
    assert not wandb_children()


# ------------------------------------------------------------------ the fan-out


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.closed = threading.Event()

    def log_scalars(self, values: Mapping[str, float], step: int) -> None:
        self.calls.append(("scalars", (dict(values), step)))

    def log_final(self, path: Path) -> None:
        self.calls.append(("final", path))

    def close(self) -> None:
        self.closed.set()


class Broken(Recorder):
    def log_scalars(self, values: Mapping[str, float], step: int) -> None:
        raise OSError("disk full")


def test_a_failing_tracker_is_dropped_with_one_warning_and_the_others_go_on(
    caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    good, broken = Recorder(), Broken()

    def cannot_start() -> Recorder:
        raise RuntimeError("no such server")

    trackers = Trackers({"good": lambda: good, "broken": lambda: broken, "gone": cannot_start})
    with caplog.at_level(logging.WARNING, logger="learner.tracking"):
        run_all(trackers, tmp_path)
    assert good.calls == [("scalars", p) for p in POINTS] + [("final", tmp_path)]
    assert good.closed.is_set() and broken.closed.is_set()  # the failed one is closed too
    warnings = [r.getMessage() for r in caplog.records]
    assert warnings == [
        "gone: could not start, tracking it is off: RuntimeError: no such server",
        "broken: failed, tracking it is off: OSError: disk full",
    ]


def test_a_stuck_tracker_never_blocks_the_training_and_close_is_bounded(
    caplog: pytest.LogCaptureFixture,
) -> None:
    release = threading.Event()

    class Stuck(Recorder):
        def log_scalars(self, values: Mapping[str, float], step: int) -> None:
            release.wait()

    trackers = Trackers({"stuck": Stuck})
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="learner.tracking"):
        for step in range(20_000):  # past the queue: the rest are dropped, said once
            trackers.log_scalars({"losses/loss": 1.0}, step)
        trackers.close(timeout_s=0.2)
    assert time.monotonic() - started < 10
    release.set()
    assert [r.getMessage() for r in caplog.records] == [
        "trackers are behind: dropping scalars until they catch up",
        "trackers (stuck) still busy after 0.2s: going on without them",
    ]


def test_run_handle_gives_the_trackers_the_finite_scalars_at_the_tensorboard_step(
    tmp_path: Path,
) -> None:
    recorder = Recorder()
    trackers = Trackers({"recorder": lambda: recorder})

    class Writer:
        def add_scalar(self, tag: str, scalar_value: float, global_step: int) -> None:
            pass

    handle = RunHandle(
        run_name="demo",
        source="learner",
        progress=Progress(samples=96),
        bus=None,  # type: ignore[arg-type]
        dirs=RunDirs.of(tmp_path),
        writer=Writer(),
        tensorboard_step=lambda p: p.samples,
        trackers=trackers,
    )
    handle.write_scalars({"losses/loss": 0.5, "charts/nan": float("nan")}, 96)
    trackers.close()
    assert recorder.calls == [("scalars", ({"losses/loss": 0.5}, 96))]


# ------------------------------------------------------------------ settings


def test_every_tracker_kind_is_a_run_tracking_setting_with_help() -> None:
    assert set(TRACKERS) == set(TrackingSection.model_fields)
    for model in (TrackingSection, WandbSettings, MlflowSettings):
        for name, field in model.model_fields.items():
            assert field.description, f"{model.__name__}.{name} has no description"


def write(tmp_path: Path, tracking: str) -> Path:
    path = tmp_path / "run.yaml"
    text = f"""\
    run:
      name: demo
      tracking:
{textwrap.indent(textwrap.dedent(tracking), " " * 8)}
    services:
      - name: hb
        service: heartbeat
        main: true
    """
    path.write_text(textwrap.dedent(text))
    return path


@pytest.mark.parametrize(
    ("tracking", "expected"),
    [
        (
            "wandb: {mode: offlin}",
            "run.yaml:4: run.tracking.wandb.mode: Input should be 'offline', 'online' or "
            "'disabled'",
        ),
        (
            "wandb: {projct: demo}",
            "run.yaml:4: run.tracking.wandb.projct: unknown key 'projct' (did you mean 'project'?)",
        ),
        ("wandb: {project: a/b}", "run.yaml:4: run.tracking.wandb.project: String should match"),
        ("wandb: {tags: ['']}", "run.yaml:4: run.tracking.wandb.tags[0]: String should have"),
        ("mlflow: {experiment: ''}", "run.yaml:4: run.tracking.mlflow.experiment: String should"),
        ("mlflow: 3", "run.yaml:4: run.tracking.mlflow: Input should be a valid dictionary"),
        ("tensorboard: true", "run.yaml:4: run.tracking.tensorboard: unknown key 'tensorboard'"),
    ],
)
def test_bad_tracking_settings_name_the_key_and_line(
    tmp_path: Path, tracking: str, expected: str
) -> None:
    with pytest.raises(ConfigError) as info:
        load_run_config(write(tmp_path, tracking), {})
    assert str(info.value).startswith(f"{tmp_path}/{expected}"), str(info.value)


def test_true_turns_a_tracker_on_with_its_defaults_and_false_or_nothing_leaves_it_off(
    tmp_path: Path,
) -> None:
    config = load_run_config(write(tmp_path, "wandb: true\nmlflow: false"), {})
    assert config.run.tracking.enabled() == {"wandb": WandbSettings()}
    assert WandbSettings().mode == "offline"
    config = load_run_config(write(tmp_path, "wandb:"), {})
    assert config.run.tracking.enabled() == {}


def test_a_missing_package_is_a_config_error_naming_the_setting_and_pip(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a)
    )
    path = write(tmp_path, "wandb: {mode: offline}\nmlflow: true")
    load_run_config(path, {})  # a service that only reads the file needs no tracker
    with pytest.raises(ConfigError) as info:
        load_run_config(path, {}, check_machine=True)  # `rlfleet validate`, `rlfleet up`
    assert str(info.value) == (
        f"{path}:4: run.tracking.wandb: wandb is on but the 'wandb' package is not installed: "
        "pip install 'rlfleet[tracking]' (or pip install wandb)"
    )
    with pytest.raises(ConfigError, match=r"run\.tracking\.wandb: .* pip install"):
        open_trackers(TrackingSection(wandb=WandbSettings()), tracked_run(tmp_path))


def test_the_params_name_every_nested_setting_and_fit_mlflow() -> None:
    params = flat_params({"a": {"b": 1, "c": [1, 2], "d": {}}, "e f@g": "x" * 7000, "h": None})
    assert params == {"a.b": "1", "a.c": "[1, 2]", "a.d": "{}", "e f_g": "x" * 6000, "h": "null"}
