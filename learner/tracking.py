"""Experiment trackers the learner logs to beside TensorBoard: Weights & Biases and MLflow, each
on when the run file says so (``run.tracking``, services/tracking.py).

A tracker is three calls (``Tracker``): the scalars of a point, under TensorBoard's names and at
its step; the final policy's folder at the end of the run; close. ``TRACKERS`` maps each kind
(a field of ``TrackingSection``) to the function that opens one, so a kind is added in one
place. Their packages are imported only when a run turns them on.

Tracking is best effort and must never cost the training: every tracker runs on one worker
thread behind a bounded queue (``Trackers``), so a slow file system or tracking server delays
only the tracker; a tracker that fails is logged once and dropped, the others and the learner go
on; and ``close`` waits a bounded time. What the trackers record about the run: its resolved
config (``resolved_config``: the run file with the job expanded and this learner's settings
complete), as W&B's config and MLflow's params. Their run ids are kept in
``<run dir>/learner/tracking.json``, so a restarted learner continues the same tracked run.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import queue
import re
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlsplit, urlunsplit

from pydantic import BaseModel

from services.config import RunConfig, read_run_config
from services.errors import ConfigError
from services.registry import ServiceContext
from services.tracking import MlflowSettings, TrackingSection, WandbSettings, missing_packages

__all__ = [
    "CLOSE_S",
    "NO_TRACKERS",
    "STEP_METRIC",
    "TRACKERS",
    "TrackedRun",
    "Tracker",
    "Trackers",
    "flat_params",
    "open_trackers",
    "resolved_config",
    "trackers_of",
]

log = logging.getLogger(__name__)

CLOSE_S = 60.0  # the most ``Trackers.close`` waits for the trackers to finish
QUEUE_SIZE = 10_000  # calls waiting for the worker; past it scalars are dropped (and said once)
STEP_METRIC = "global_step"  # W&B's x axis: TensorBoard's step, logged with every point
IDS_FILE = "tracking.json"  # under <run dir>/learner/: each tracker's run id
MLFLOW_PARAM_CHARS = 6000  # MLflow's limit on a param's value
_MLFLOW_NAME = re.compile(r"[^\w./\- :]")  # what MLflow refuses in a metric or param name


class Tracker(Protocol):
    """One experiment tracker, called from one thread at a time."""

    def log_scalars(self, values: Mapping[str, float], step: int) -> None:
        """``values`` (finite) at TensorBoard's ``step``."""

    def log_final(self, path: Path) -> None:
        """The run reached its end; ``path`` is its final policy's folder (``final/``)."""

    def close(self) -> None:
        """Flush and end the tracked run; release what it started (processes, files)."""


@dataclass(frozen=True)
class TrackedRun:
    """What the trackers record about the run, beside their own settings."""

    name: str
    run_dir: Path
    config: dict[str, Any]  # the resolved run file (``resolved_config``)

    @property
    def ids_file(self) -> Path:
        return self.run_dir / "learner" / IDS_FILE

    def remembered_id(self, kind: str) -> str | None:
        """The run id the tracker ``kind`` recorded before in this run directory."""
        try:
            found = json.loads(self.ids_file.read_text()).get(kind)
        except (OSError, ValueError, AttributeError):
            return None
        return found if isinstance(found, str) else None

    def remember_id(self, kind: str, run_id: str) -> None:
        try:
            ids = json.loads(self.ids_file.read_text())
        except (OSError, ValueError):
            ids = {}
        ids = {**(ids if isinstance(ids, dict) else {}), kind: run_id}
        self.ids_file.parent.mkdir(parents=True, exist_ok=True)
        self.ids_file.write_text(json.dumps(ids, indent=2, sort_keys=True) + "\n")


# ------------------------------------------------------------------ the run's record


def resolved_config(config: RunConfig, service: str, settings: BaseModel) -> dict[str, Any]:
    """The run file as the trackers record it: run, nats, security and the job's knobs as
    written, and every service's entry keyed by instance name (so that a setting keeps one
    readable name, ``services.learner.settings.lr``) with this learner's settings complete
    (defaults and environment overrides in). A password in ``nats.url`` is left out."""
    data = config.model_dump(mode="json", exclude={"services"})
    services: dict[str, Any] = {}
    for entry in config.services:
        dumped = entry.model_dump(mode="json", exclude={"name"})
        if entry.name == service:
            dumped["settings"] = settings.model_dump(mode="json")
        services[entry.name] = dumped
    data["services"] = services
    url = data.get("nats", {}).get("url")
    if url:
        data["nats"]["url"] = ",".join(_without_credentials(one) for one in url.split(","))
    return data


def _without_credentials(url: str) -> str:
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return url
    return urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))


def flat_params(config: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """``config`` as MLflow params: nested keys joined by ``.``, every other value as JSON (a
    string as itself), cut to MLflow's limit; names MLflow refuses get ``_`` for the bad
    characters."""
    params: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            params.update(flat_params(value, name + "."))
            continue
        text = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
        params[_MLFLOW_NAME.sub("_", name)] = text[:MLFLOW_PARAM_CHARS]
    return params


# ------------------------------------------------------------------ Weights & Biases


class WandbTracker:
    """A W&B run: scalars with TensorBoard's step as ``global_step`` (W&B's own step must only
    grow, and an LM learner's SFT steps come before its updates restart at 1), the final
    policy as a ``model`` artifact whose files stay where they are."""

    def __init__(self, settings: WandbSettings, run: Any, artifact: str) -> None:
        self.settings, self.run, self.artifact = settings, run, artifact

    def log_scalars(self, values: Mapping[str, float], step: int) -> None:
        self.run.log({**values, STEP_METRIC: step})

    def log_final(self, path: Path) -> None:
        if not self.settings.log_final:
            return
        import wandb

        artifact = wandb.Artifact(self.artifact, type="model")
        artifact.add_dir(str(path), policy="immutable")  # referenced, not copied to staging
        self.run.log_artifact(artifact, aliases=["final"])

    def close(self) -> None:
        import wandb

        try:
            self.run.finish()
        finally:
            wandb.teardown()  # ends wandb's service process with the learner


def open_wandb(settings: WandbSettings, run: TrackedRun) -> Tracker:
    os.environ.setdefault("WANDB_SILENT", "true")  # wandb's own console lines, artifacts' too
    import wandb

    root = settings.dir if settings.dir is not None else run.run_dir
    root.mkdir(parents=True, exist_ok=True)
    run_id = run.remembered_id("wandb") or uuid.uuid4().hex[:12]
    quiet = wandb.Settings(
        silent=True,
        console="off",  # the learner's log is the run's log; no stdout capture
        x_disable_stats=True,  # no system-metrics sampler beside the training
        x_disable_meta=True,
        x_disable_machine_info=True,
        disable_git=True,
        disable_code=True,
        save_code=False,
        x_save_requirements=False,
        disable_job_creation=True,
    )
    try:
        wandb_run = wandb.init(
            mode=settings.mode,
            project=settings.project,
            entity=settings.entity,
            name=settings.name or run.name,
            tags=list(settings.tags),
            dir=str(root),
            config=run.config,
            id=run_id,
            resume="allow" if settings.mode == "online" else None,  # offline runs cannot resume
            reinit="create_new",
            settings=quiet,
        )
        wandb_run.define_metric(STEP_METRIC)
        wandb_run.define_metric("*", step_metric=STEP_METRIC)
    except BaseException:
        wandb.teardown()  # its service process may be up already (no API key, no server)
        raise
    run.remember_id("wandb", run_id)
    return WandbTracker(settings, wandb_run, artifact=f"{run.name}-final")


# ------------------------------------------------------------------ MLflow


class MlflowTracker:
    """An MLflow run through its client (no global active run): one batch per point, the final
    policy as the run's ``final`` artifact directory; FINISHED once the run reached its end,
    KILLED when the learner stopped before."""

    def __init__(self, settings: MlflowSettings, client: Any, run_id: str) -> None:
        self.settings, self.client, self.run_id = settings, client, run_id
        self.finished = False

    def log_scalars(self, values: Mapping[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now_ms = int(time.time() * 1000)
        metrics = [Metric(_MLFLOW_NAME.sub("_", k), v, now_ms, step) for k, v in values.items()]
        self.client.log_batch(self.run_id, metrics=metrics)

    def log_final(self, path: Path) -> None:
        if self.settings.log_final:
            self.client.log_artifacts(self.run_id, str(path), artifact_path="final")
        self.finished = True

    def close(self) -> None:
        self.client.set_terminated(self.run_id, "FINISHED" if self.finished else "KILLED")


def _is_file_store(uri: str) -> bool:
    return urlsplit(uri).scheme in ("", "file")


def open_mlflow(settings: MlflowSettings, run: TrackedRun) -> Tracker:
    from mlflow.entities import Param
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    uri = settings.tracking_uri or (run.run_dir.resolve() / "mlruns").as_uri()
    if _is_file_store(uri):
        # MLflow 3 keeps the file store in maintenance mode, behind this opt-in.
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient(tracking_uri=uri)
    name = settings.experiment or run.name
    found = client.get_experiment_by_name(name)
    experiment_id = found.experiment_id if found is not None else client.create_experiment(name)
    run_id = run.remembered_id("mlflow")
    if run_id is not None:
        try:  # the same run again; its params were logged when it was made
            client.update_run(run_id, status="RUNNING")
            return MlflowTracker(settings, client, run_id)
        except MlflowException:
            log.info("mlflow: run %s is gone from %s; starting a new one", run_id, uri)
    made = client.create_run(experiment_id, run_name=run.name)
    run_id = made.info.run_id
    params = [Param(k, v) for k, v in flat_params(run.config).items()]
    client.log_batch(run_id, params=params)
    run.remember_id("mlflow", run_id)
    return MlflowTracker(settings, client, run_id)


# The tracker kinds: a field of services.tracking.TrackingSection -> what opens one.
TRACKERS: dict[str, Callable[[Any, TrackedRun], Tracker]] = {
    "wandb": open_wandb,
    "mlflow": open_mlflow,
}


# ------------------------------------------------------------------ the fan-out


_Call = Callable[[Tracker], None]


class Trackers:
    """The run's trackers behind one worker thread, itself a ``Tracker``: calls are queued and
    return at once. The worker opens each tracker, then applies every call to each; a tracker
    whose call raises is logged once and dropped. With no trackers there is no thread."""

    def __init__(self, openers: Mapping[str, Callable[[], Tracker]]) -> None:
        self._openers = dict(openers)
        self._queue: queue.Queue[_Call | None] = queue.Queue(QUEUE_SIZE)
        self._dropping = False  # said that scalars are dropped, in this backlog
        self._thread: threading.Thread | None = None
        if self._openers:
            self._thread = threading.Thread(target=self._work, name="trackers", daemon=True)
            self._thread.start()

    @property
    def kinds(self) -> list[str]:
        return list(self._openers)

    def log_scalars(self, values: Mapping[str, float], step: int) -> None:
        values = dict(values)  # the caller's mapping may change once this returns
        self._put(lambda tracker: tracker.log_scalars(values, step))

    def log_final(self, path: Path) -> None:
        self._put(lambda tracker: tracker.log_final(path))

    def close(self, timeout_s: float = CLOSE_S) -> None:
        """Let the trackers finish what is queued and close them, waiting at most
        ``timeout_s``; one still busy then is left behind (a daemon thread) and said so."""
        thread, self._thread = self._thread, None
        if thread is None:
            return
        deadline = time.monotonic() + timeout_s
        with contextlib.suppress(queue.Full):  # the worker is stuck: the join says so
            self._queue.put(None, timeout=timeout_s)
        thread.join(max(0.0, deadline - time.monotonic()))
        if thread.is_alive():
            log.warning(
                "trackers (%s) still busy after %gs: going on without them",
                ", ".join(self._openers),
                timeout_s,
            )

    def _put(self, call: _Call) -> None:
        if self._thread is None:
            return
        try:
            self._queue.put_nowait(call)
        except queue.Full:
            if not self._dropping:
                self._dropping = True
                log.warning("trackers are behind: dropping scalars until they catch up")

    def _work(self) -> None:
        live: dict[str, Tracker] = {}
        for kind, opener in self._openers.items():
            try:
                live[kind] = opener()
            except Exception as exc:
                log.warning("%s: could not start, tracking it is off: %s", kind, _describe(exc))
        while (call := self._queue.get()) is not None:
            for kind, tracker in list(live.items()):
                try:
                    call(tracker)
                except Exception as exc:
                    log.warning("%s: failed, tracking it is off: %s", kind, _describe(exc))
                    del live[kind]
                    _close_quietly(tracker)
            if self._queue.empty():  # caught up: a new backlog is said again
                self._dropping = False
        for kind, tracker in live.items():
            try:
                tracker.close()
            except Exception as exc:
                log.warning("%s: could not close: %s", kind, _describe(exc))


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _close_quietly(tracker: Tracker) -> None:
    try:
        tracker.close()
    except Exception as exc:
        log.debug("closing a failed tracker: %s", _describe(exc))


NO_TRACKERS = Trackers({})


def open_trackers(section: TrackingSection, run: TrackedRun) -> Trackers:
    """The trackers ``section`` turns on, opening on their worker. A tracker whose package is
    missing is a ConfigError naming its key and the pip command: the run file asked for it."""
    problems = missing_packages(section)
    if problems:
        raise ConfigError(
            "; ".join(f"run.tracking.{'.'.join(map(str, loc))}: {msg}" for loc, msg in problems)
        )
    openers = {
        kind: functools.partial(TRACKERS[kind], settings, run)
        for kind, settings in section.enabled().items()
    }
    return Trackers(openers)


def trackers_of(ctx: ServiceContext[Any]) -> Trackers:
    """The trackers of the run file ``ctx`` was started from (none without one)."""
    if ctx.config_path is None:
        return NO_TRACKERS
    config = read_run_config(ctx.config_path)
    section = config.run.tracking
    if not section.enabled():
        return NO_TRACKERS
    try:
        record = resolved_config(config, ctx.name, ctx.settings)
    except Exception as exc:  # the record is a nicety: the scalars go out without it
        log.warning("the trackers get no run config: %s", _describe(exc))
        record = {}
    run = TrackedRun(name=ctx.run_name, run_dir=ctx.run_dir, config=record)
    trackers = open_trackers(section, run)
    log.info("tracking to %s", ", ".join(trackers.kinds))
    return trackers
