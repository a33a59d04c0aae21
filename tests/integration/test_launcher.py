"""`rlfleet up` end to end: a real nats-server, real service subprocesses (`heartbeat` kind).

Every run lives in tmp_path; "no process left behind" is checked by scanning /proc for any
process whose command line mentions the run directory (services get `--config <run dir>/...`,
the embedded nats-server gets its store dir inside it).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import io
import itertools
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from launch.launcher import Launcher
from launch.run_state import read_state
from services.config import load_run_config
from tests.fixtures.launch import Up, assert_nothing_left, pids_mentioning, write_config

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="scans /proc")


def test_run_finishes_when_main_exits(tmp_path: Path) -> None:
    config, run_dir = write_config(
        tmp_path,
        """\
        - name: hb-a
          service: heartbeat
          settings: {interval_s: 0.2}
        - name: hb-main
          service: heartbeat
          main: true
          settings: {interval_s: 0.2, exit_after_s: 2.5, peers: [hb-a]}
        """,
    )
    up = Up(config)
    assert up.wait() == 0, up.output
    out = up.output
    assert re.search(r"\[metrics\] service=hb-a seq=\d+", out), out
    assert re.search(r"\[metrics\] service=hb-main .*peers=hb-a@127\.0\.0\.1:\d+", out), out
    assert "main service hb-main finished" in out
    assert re.search(r"hb-main\s+heartbeat\s+exit 0\s+restarts 0", out), out
    for name in ("hb-a", "hb-main"):
        log = (run_dir / "logs" / f"{name}.log").read_text()
        assert re.match(r"=== \S+ \S+ start 1 pid \d+: ", log), log
        assert "serving on 127.0.0.1" in log
    assert (run_dir / "config.yaml").read_text() == config.read_text()
    # state.json: how the run ended, for watchers that are not its parent (the studio)
    state = read_state(run_dir)
    assert state is not None and (state.state, state.exit) == ("finished", 0), state
    assert state.message == "main service hb-main finished" and state.ended >= state.started
    assert [s["name"] for s in state.services] == ["hb-a", "hb-main"]
    assert state.services[1]["state"] == "finished" and state.services[1]["restarts"] == 0
    assert_nothing_left(run_dir)


def test_the_last_events_services_send_as_they_stop_reach_metrics_jsonl(tmp_path: Path) -> None:
    """A rollout driver sends its last metrics as it stops, after the main service finished: every
    event a service sent before it exited is in metrics.jsonl (the launcher's monitor reads to the
    end of what the server sent before it stops, rather than being cancelled with events in
    flight)."""
    names, burst = [f"hb-{i}" for i in range(4)], 200
    stoppers = "".join(
        f"- {{name: {n}, service: heartbeat, settings: {{interval_s: 60, final_beats: {burst}}}}}\n"
        for n in names
    )
    config, run_dir = write_config(
        tmp_path,
        stoppers
        + "- {name: hb-main, service: heartbeat, main: true,"
        + " settings: {interval_s: 0.2, exit_after_s: 1.0}}\n",
    )
    up = Up(config)
    assert up.wait() == 0, up.output
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    finals = collections.Counter(row["service"] for row in rows if row["values"].get("final"))
    assert finals == dict.fromkeys(names, burst), (finals, up.output)
    assert_nothing_left(run_dir)


def test_crashing_service_is_restarted_then_fails_the_run(tmp_path: Path) -> None:
    config, run_dir = write_config(
        tmp_path,
        """\
        - name: crashy
          service: heartbeat
          restarts: 2
          settings: {fail_after_s: 0.5}
        - name: hb-main
          service: heartbeat
          main: true
        """,
    )
    up = Up(config)
    assert up.wait() == 1, up.output
    out = up.output
    assert "crashy crashed (exit 1); restart 1/2" in out
    assert "crashy crashed (exit 1); restart 2/2" in out
    assert "crashy failed (exit 1) after 2 restart(s)" in out
    assert "failing on purpose" in out  # the tail of its log is shown
    assert re.search(r"crashy\s+heartbeat\s+exit 1\s+restarts 2", out), out
    log = (run_dir / "logs" / "crashy.log").read_text()
    assert [m.group(1) for m in re.finditer(r"=== \S+ \S+ start (\d) pid", log)] == ["1", "2", "3"]
    state = read_state(run_dir)
    assert state is not None and (state.state, state.exit) == ("failed", 1), state
    assert state.message.startswith("crashy failed (exit 1) after 2 restart(s)"), state.message
    assert_nothing_left(run_dir)


def test_sigint_stops_every_process(tmp_path: Path) -> None:
    config, run_dir = write_config(
        tmp_path,
        """\
        - name: hb-a
          service: heartbeat
          settings: {interval_s: 0.2}
        - name: hb-b
          service: heartbeat
          settings: {interval_s: 0.2}
        """,
    )
    up = Up(config)
    up.wait_for(r"\[metrics\] service=hb-b")
    service_pids = [
        int(m.group(1))
        for name in ("hb-a", "hb-b")
        for m in re.finditer(r"pid (\d+)", (run_dir / "logs" / f"{name}.log").read_text())
    ]
    assert len(service_pids) == 2
    assert set(service_pids) <= set(pids_mentioning(str(run_dir)))  # both running
    state = read_state(run_dir)
    assert state is not None and state.state == "running" and state.pid == up.proc.pid, state
    up.proc.send_signal(signal.SIGINT)
    assert up.wait(20) == 0, up.output  # no main service: Ctrl-C is the normal end
    state = read_state(run_dir)
    assert state is not None and (state.state, state.message) == ("finished", "stopped by SIGINT")
    assert re.search(r"hb-a\s+heartbeat\s+exit 0", up.output), up.output
    assert_nothing_left(run_dir)


def test_malformed_config_exits_2_before_starting_anything(tmp_path: Path) -> None:
    config, run_dir = write_config(
        tmp_path,
        """\
        - name: hb-a
          service: heartbeat
          settings: {interval_s: -1}
        """,
    )
    result = subprocess.run(
        [sys.executable, "-m", "launch.cli", "up", str(config)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 2
    assert f"{config}:7: services[0].settings.interval_s: Input should be greater" in result.stderr
    assert not run_dir.exists()  # nothing started: no logs, no nats store
    assert pids_mentioning(str(run_dir)) == []


def test_service_never_healthy_fails_with_log_tail(tmp_path: Path) -> None:
    config, run_dir = write_config(
        tmp_path,
        """\
        - name: slow
          service: heartbeat
          settings: {healthy_after_s: 30}
        """,
    )
    out = io.StringIO()
    launcher = Launcher(load_run_config(config, {}), config, out=out, health_timeout_s=2)
    assert launcher.run() == 1
    text = out.getvalue()
    assert "slow not healthy after 2s" in text
    assert f"last lines of {run_dir / 'logs' / 'slow.log'}" in text
    assert_nothing_left(run_dir)


def test_services_stop_when_the_launcher_is_killed(tmp_path: Path) -> None:
    config, run_dir = write_config(
        tmp_path,
        """\
        - name: hb-a
          service: heartbeat
          settings: {interval_s: 0.2}
        """,
    )
    up = Up(config)
    up.wait_for(r"\[metrics\] service=hb-a")
    log = (run_dir / "logs" / "hb-a.log").read_text()
    service_pid = int(re.search(r"pid (\d+)", log).group(1))  # type: ignore[union-attr]
    up.proc.kill()  # SIGKILL: the launcher gets no chance to stop anything
    up.wait(10)
    try:
        deadline = time.monotonic() + 8
        while service_pid in pids_mentioning(str(run_dir)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert service_pid not in pids_mentioning(str(run_dir))
        # The parent-death SIGTERM usually wins the race with the orphan poll; both stop it.
        log = (run_dir / "logs" / "hb-a.log").read_text()
        assert "received SIGTERM: stopping" in log or "launcher (pid" in log, log
        assert_nothing_left(run_dir)  # nats-server too (parent-death SIGKILL)
    finally:
        for pid in pids_mentioning(str(run_dir)):  # whatever is left, started by this test
            os.kill(pid, signal.SIGKILL)


def test_event_lines_per_message_type() -> None:
    from google.protobuf import struct_pb2

    from launch.console import format_event
    from rlfleet.bus.v1 import events_pb2

    beat = struct_pb2.Struct()
    beat.update({"uptime_s": 1.23456, "service": "hb", "seq": 3})
    assert format_event("rlfleet.v1.events.r.metrics", beat.SerializeToString(), None) == (
        "[metrics] service=hb seq=3 uptime_s=1.235"
    )
    metrics = events_pb2.Metrics(source="learner", step=7, scalars={"losses/kl": 0.5})
    headers = {"Rlfleet-Type": "rlfleet.bus.v1.Metrics"}
    assert format_event("rlfleet.v1.events.r.metrics", metrics.SerializeToString(), headers) == (
        "[metrics] learner step=7 version=0 losses/kl=0.5"
    )
    episode = events_pb2.EpisodeStats(source="a-0", env_id="CartPole-v1", episode_return=21.0)
    headers = {"Rlfleet-Type": "rlfleet.bus.v1.EpisodeStats"}
    # One line per episode would flood the terminal; metrics carry the episode means.
    data = episode.SerializeToString()
    assert format_event("rlfleet.v1.events.r.episodes", data, headers) is None
    status = {"Rlfleet-Type": "rlfleet.bus.v1.ServiceStatus"}
    assert format_event("rlfleet.v1.events.r.status", b"", status) is None  # not shown
    unknown = {"Rlfleet-Type": "other.Thing"}
    assert format_event("rlfleet.v1.events.r.metrics", b"xy", unknown) == (
        "[metrics] <other.Thing: 2 bytes>"
    )


# --- the console: progress line, --verbose, metrics.jsonl --------------------------------------


class TimedUp(Up):
    """`Up` that also notes when each output line arrived."""

    def _read(self) -> None:
        self.stamps: list[float] = []
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.stamps.append(time.monotonic())
            self.lines.append(line.rstrip("\n"))


def publish_like_a_learner(url: str, run: str, seconds: float, stop: threading.Event) -> None:
    """What a learner sends the console, 10 times a second: Metrics (one long line each in
    verbose mode) and a progress record; once, the resume notice."""
    from rlfleet.bus.v1 import events_pb2
    from services.bus import Bus, events_subject
    from services.progress import PROGRESS_EVENTS, progress_record

    async def main() -> None:
        bus = await Bus.connect(url, name="fake-learner")
        try:
            resumed = events_pb2.RunStatus(
                run=run,
                state=events_pb2.RUN_STATE_RUNNING,
                source="learner",
                message="resumed from checkpoint at update 84",
            )
            deadline = time.monotonic() + seconds
            update = 84
            while time.monotonic() < deadline and not stop.is_set():
                update += 1
                if update % 10 == 5:  # until the launcher's monitor is surely subscribed
                    await bus.publish_event(events_subject(run, "status"), resumed)
                scalars = {"charts/episodic_return": 475.0, "losses/approx_kl": 0.01}
                metrics = events_pb2.Metrics(
                    run=run, source="learner", step=update, scalars=scalars, policy_version=update
                )
                await bus.publish_event(events_subject(run, "metrics"), metrics)
                record = progress_record(
                    "learner",
                    unit="update",
                    done=update,
                    total=1000,
                    version=update,
                    headline=[("reward", 0.41), ("tok/s", 6100.0)],
                )
                await bus.publish_event(events_subject(run, PROGRESS_EVENTS), record)
                await asyncio.sleep(0.1)
        finally:
            await bus.close()

    asyncio.run(main())


@contextlib.contextmanager
def fake_learner(url: str, run: str, seconds: float) -> Iterator[None]:
    stop = threading.Event()
    thread = threading.Thread(target=publish_like_a_learner, args=(url, run, seconds, stop))
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(10)


def console_config(tmp_path: Path, url: str) -> tuple[Path, Path]:
    config, run_dir = write_config(
        tmp_path,
        """\
        - name: hb-main
          service: heartbeat
          main: true
          settings: {interval_s: 0.5, exit_after_s: 5}
        """,
    )
    config.write_text(
        config.read_text().replace("services:\n", f"nats: {{url: '{url}'}}\nservices:\n")
    )
    return config, run_dir


PROGRESS_LINE = re.compile(
    r"^itest  update (\d+)/1k  \d+%  reward 0\.41  tok/s 6\.1k  v\d+(  ETA \S+)?$"
)


def test_progress_line_once_per_interval_and_metrics_jsonl(
    tmp_path: Path, nats_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RLFLEET_PROGRESS_INTERVAL_S", "1")
    monkeypatch.delenv("RLFLEET_VERBOSE", raising=False)
    config, run_dir = console_config(tmp_path, nats_url)
    with fake_learner(nats_url, "itest", 9):
        up = TimedUp(config)
        assert up.wait() == 0, up.output
    out = up.output
    progress = [
        (stamp, line)
        for stamp, line in zip(up.stamps, up.lines, strict=True)
        if PROGRESS_LINE.match(line)
    ]
    # 10 records a second: a line a second, not one a record (the last comes at the end). How
    # many seconds the run lasts depends on the machine's load: the bounds are rates, not counts.
    assert len(progress) >= 2, out
    gaps = [b[0] - a[0] for a, b in itertools.pairwise(progress[:-1])]
    assert all(gap >= 0.8 for gap in gaps), (gaps, out)
    assert any("ETA " in line for _, line in progress), out
    assert "[metrics] learner" not in out  # summarised by the progress line
    assert re.search(r"\[metrics\] service=hb-main seq=\d+", out), out  # no progress record
    assert "learner: resumed from checkpoint at update 84" in out
    assert "main service hb-main finished" in out

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    services = {row["service"] for row in rows}
    assert services == {"learner", "hb-main"}, services
    learner = [row for row in rows if row["service"] == "learner"]
    assert len(learner) >= 5 * len(progress), (len(learner), len(progress))  # every event
    assert learner[0]["kind"] == "metrics" and learner[0]["values"]["losses/approx_kl"] == 0.01
    assert all(isinstance(row["time"], float) for row in rows)
    assert_nothing_left(run_dir)


def test_verbose_prints_every_metrics_event(tmp_path: Path, nats_url: str) -> None:
    config, run_dir = console_config(tmp_path, nats_url)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RLFLEET_PROGRESS_INTERVAL_S": "1"}
    with fake_learner(nats_url, "itest", 9):
        result = subprocess.run(
            [sys.executable, "-m", "launch.cli", "up", "--verbose", str(config)],
            capture_output=True,
            text=True,
            timeout=60,
            env=env,
            cwd=tmp_path,
        )
    out = result.stdout
    assert result.returncode == 0, out + result.stderr
    lines = re.findall(r"\[metrics\] learner step=\d+ version=\d+ .*losses/approx_kl=0\.01", out)
    assert len(lines) >= 10, out  # one per event (10 a second)
    assert any(PROGRESS_LINE.match(line) for line in out.splitlines()), out
    assert_nothing_left(run_dir)
