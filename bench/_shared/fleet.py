"""A training run under `rlfleet up` that benchmarks watch and add replicas to while it trains.

`launched(path, work)` starts `launch.cli up` on a run file (its output in `work/up.log`), waits
for the run's NATS url, and yields a `LaunchedRun`: `join_env_server(instance, replica)` starts
another replica of an env-server instance as a deployment adds one (`services.serve env_server
--name <instance>` with the run's NATS url and name; the actors find it in the run's membership).
On exit the run is stopped in order (SIGINT, as Ctrl-C) and the joined replicas terminated.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import yaml

from bench._shared.results import ROOT

__all__ = ["LaunchedRun", "launched", "learner_steps", "steps_per_s", "wait_for"]

T = TypeVar("T")


def wait_for(what: str, check: Callable[[], T], timeout_s: float, poll_s: float = 0.5) -> T:
    """``check()``'s first truthy answer; TimeoutError naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not (found := check()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} after {timeout_s:g} s")
        time.sleep(poll_s)
    return found


def learner_steps(run_dir: Path) -> list[tuple[float, int]]:
    """(time, global env step) of every learner metrics record so far."""
    out: list[tuple[float, int]] = []
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return out
    for line in path.read_text().splitlines():
        with contextlib.suppress(ValueError):
            record = json.loads(line)
            step = record.get("values", {}).get("charts/global_step")
            if record.get("service") == "learner" and step is not None:
                out.append((float(record["time"]), int(step)))
    return out


def steps_per_s(points: list[tuple[float, int]], since: float, until: float) -> float | None:
    """Env steps/s between the first and last learner record inside [since, until]; None with
    fewer than two records there."""
    inside = [(t, s) for t, s in points if since <= t <= until]
    if len(inside) < 2 or inside[-1][0] <= inside[0][0]:
        return None
    return (inside[-1][1] - inside[0][1]) / (inside[-1][0] - inside[0][0])


@dataclass
class LaunchedRun:
    path: Path  # the run file
    run: str  # the run's name
    nats_url: str
    up: subprocess.Popen[bytes]
    log_path: Path
    env: dict[str, str]
    joined: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def nats_announced(self) -> str | None:
        """The NATS url the launcher printed, None until then; RuntimeError if it exited."""
        found = re.search(r"NATS at (nats://\S+)", self.log())
        if found is None and self.up.poll() is not None:
            tail = "\n".join(self.log().splitlines()[-20:])
            raise RuntimeError(f"rlfleet up exited with {self.up.returncode}:\n{tail}")
        return found[1] if found else None

    def join_env_server(self, instance: str, replica: str) -> subprocess.Popen[bytes]:
        """Start replica ``replica`` of env-server ``instance`` (its settings from the run
        file, as its deployment would read them)."""
        env = {
            **self.env,
            "RLFLEET_RUN_NAME": self.run,
            "RLFLEET_NATS_URL": self.nats_url,
            "RLFLEET_REPLICA_NAME": f"{instance}#{replica}",
            "RLFLEET_LOG_LEVEL": "WARNING",
        }
        serve = ["services.serve", "env_server", "--name", instance, "--config", str(self.path)]
        log = self.log_path.with_name(f"{instance}#{replica}.log")
        with log.open("w") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", *serve],
                cwd=ROOT,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        self.joined.append(proc)
        return proc

    def wait(self, timeout_s: float | None = None) -> int:
        """The launcher's exit status once the run ends by itself; the joined replicas are
        stopped then (their run, and its NATS, are gone)."""
        status = self.up.wait(timeout_s)
        self.stop_joined()
        return status

    def stop_joined(self) -> None:
        for proc in self.joined:
            proc.terminate()
        for proc in self.joined:
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@contextlib.contextmanager
def launched(path: Path, work: Path, stop_timeout_s: float = 120.0) -> Iterator[LaunchedRun]:
    run = yaml.safe_load(path.read_text())["run"]["name"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    log_path = work / "up.log"
    with log_path.open("w") as log:
        up = subprocess.Popen(
            [sys.executable, "-m", "launch.cli", "up", str(path)],
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        launched_run = LaunchedRun(path, run, "", up, log_path, env)
        try:
            launched_run.nats_url = str(wait_for("NATS url", launched_run.nats_announced, 120))
            yield launched_run
        finally:
            if up.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(up.pid, signal.SIGINT)  # an orderly stop, as Ctrl-C
                try:
                    up.wait(stop_timeout_s)
                except subprocess.TimeoutExpired:
                    os.killpg(up.pid, signal.SIGKILL)
                    up.wait()
            launched_run.stop_joined()
