"""`rlfleet up` starts services as soon as what they need is up, and stops them in reverse
dependency order (services/start_order.py), with real `heartbeat` services.

When each service started, became healthy and was told to stop is read from its own log: the
server's "gRPC listening" line (the process is up), the heartbeat's "serving on" line (health
SERVING, `healthy_after_s` later) and "received SIGTERM" (millisecond timestamps).
"""

from __future__ import annotations

import re
import signal
import sys
from datetime import datetime
from pathlib import Path

import pytest

from tests.fixtures.launch import Up, assert_nothing_left, write_config

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="scans /proc")

HEALTHY_AFTER_S = 3.0  # long beside a heartbeat's start (about a second), so order is clear


def when(run_dir: Path, name: str, text: str) -> float:
    """The time of the first line of ``name``'s log containing ``text`` (epoch seconds)."""
    for line in (run_dir / "logs" / f"{name}.log").read_text().splitlines():
        if text in line:
            return datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
    raise AssertionError(f"no {text!r} in the log of {name}")


def test_independent_services_start_together_and_a_dependent_waits(tmp_path: Path) -> None:
    config, run_dir = write_config(
        tmp_path,
        f"""\
        - name: slow-a
          service: heartbeat
          after: []
          settings: {{interval_s: 0.2, healthy_after_s: {HEALTHY_AFTER_S}}}
        - name: slow-b
          service: heartbeat
          after: []
          settings: {{interval_s: 0.2, healthy_after_s: {HEALTHY_AFTER_S}}}
        - name: main
          service: heartbeat
          main: true
          after: [slow-a, slow-b]
          settings: {{interval_s: 0.2, exit_after_s: 1}}
        """,
    )
    up = Up(config, run_dir, services=("slow-a", "slow-b", "main"))
    try:
        assert up.wait(60) == 0, up.diagnostics()
    finally:
        up.stop()
    out = up.output
    assert "rlfleet: starting slow-a, slow-b at once; main after slow-a, slow-b" in out, out
    assert "rlfleet: starting main (heartbeat): slow-a, slow-b up" in out, out
    up_at = {name: when(run_dir, name, "gRPC listening on") for name in ("slow-a", "slow-b")}
    healthy = {name: when(run_dir, name, "serving on") for name in ("slow-a", "slow-b")}
    # Both processes were up before either was healthy: started together, not one by one.
    assert up_at["slow-b"] < healthy["slow-a"] and up_at["slow-a"] < healthy["slow-b"], (
        up_at,
        healthy,
    )
    # The dependent started only once both were healthy, its process long before (warm start:
    # spawned at once, its imports done while it waited at its start gate).
    assert when(run_dir, "main", "at the start gate") > max(healthy.values())
    assert when(run_dir, "main", "gRPC listening on") > max(healthy.values())
    assert spawned(run_dir, "main") + 1 < min(healthy.values())
    assert_nothing_left(run_dir)


def spawned(run_dir: Path, name: str) -> float:
    """When the launcher spawned ``name``'s first process: its log's header (whole seconds)."""
    header = (run_dir / "logs" / f"{name}.log").read_text().splitlines()[0]
    assert header.startswith("=== "), header
    return datetime.strptime(header[4:23], "%Y-%m-%d %H:%M:%S").timestamp()


def test_a_run_stopped_before_a_service_could_start_leaves_it_not_started(tmp_path: Path) -> None:
    config, run_dir = write_config(
        tmp_path,
        """        - name: never-healthy
          service: heartbeat
          settings: {interval_s: 0.2, healthy_after_s: 600}
        - name: waiting
          service: heartbeat
          after: [never-healthy]
          settings: {interval_s: 0.2}
        """,
    )
    up = Up(config, run_dir, services=("never-healthy", "waiting"))
    try:
        up.wait_until(
            "the waiting service's process",
            lambda: (run_dir / "logs" / "waiting.log").exists(),
            timeout_s=60,
        )
        up.proc.send_signal(signal.SIGINT)
        assert up.wait(60) == 0, up.diagnostics()  # no main service: a stop is a clean end
    finally:
        up.stop()
    assert re.search(r"waiting\s+heartbeat\s+not started\s+restarts 0", up.output), up.output
    assert "gRPC listening" not in (run_dir / "logs" / "waiting.log").read_text()
    assert_nothing_left(run_dir)


def test_stop_goes_in_reverse_dependency_order(tmp_path: Path) -> None:
    config, run_dir = write_config(
        tmp_path,
        """\
        - name: base
          service: heartbeat
          after: []
          settings: {interval_s: 0.2}
        - name: top
          service: heartbeat
          after: [middle]
          settings: {interval_s: 0.2}
        - name: middle
          service: heartbeat
          after: [base]
          settings: {interval_s: 0.2}
        """,
    )
    up = Up(config, run_dir, services=("base", "middle", "top"))
    try:
        up.wait_for(r"\[metrics\] service=top", timeout_s=60)
        up.proc.send_signal(signal.SIGINT)
        assert up.wait(60) == 0, up.diagnostics()  # no main service: a stop is a clean end
    finally:
        up.stop()
    assert "rlfleet: starting base; top after middle; middle after base" in up.output
    told = {name: when(run_dir, name, "received SIGTERM") for name in ("base", "middle", "top")}
    stopped = {name: when(run_dir, name, "gRPC server stopped") for name in ("middle", "top")}
    # Each is told to stop only once the one that needs it has stopped.
    assert stopped["top"] <= told["middle"] and stopped["middle"] <= told["base"], (told, stopped)
    assert_nothing_left(run_dir)


def test_a_service_imports_while_what_it_needs_comes_up(tmp_path: Path) -> None:
    """Warm start: `main`'s preload (a 3 s "import") runs while `slow` becomes healthy (3 s), so
    main is serving about when slow is, not 3 s after it."""
    config, run_dir = write_config(
        tmp_path,
        f"""\
        - name: slow
          service: heartbeat
          settings: {{interval_s: 0.2, healthy_after_s: {HEALTHY_AFTER_S}}}
        - name: main
          service: heartbeat
          main: true
          after: [slow]
          settings: {{interval_s: 0.2, exit_after_s: 1, preload_s: {HEALTHY_AFTER_S}}}
        """,
    )
    up = Up(config, run_dir, services=("slow", "main"))
    try:
        assert up.wait(60) == 0, up.diagnostics()
    finally:
        up.stop()
    healthy = when(run_dir, "slow", "serving on")
    listening = when(run_dir, "main", "gRPC listening on")
    assert healthy < listening < healthy + HEALTHY_AFTER_S - 1, (healthy, listening)
    assert_nothing_left(run_dir)


def test_a_service_that_dies_at_its_gate_is_restarted_then_fails_the_run(tmp_path: Path) -> None:
    config, run_dir = write_config(
        tmp_path,
        """\
        - name: base
          service: heartbeat
          settings: {interval_s: 0.2}
        - name: broken
          service: heartbeat
          after: [base]
          restarts: 1
          settings: {interval_s: 0.2, preload_fails: true}
        """,
    )
    up = Up(config, run_dir, services=("base", "broken"))
    try:
        assert up.wait(60) == 1, up.diagnostics()
    finally:
        up.stop()
    assert "broken crashed (exit 1); restart 1/1" in up.output, up.output
    assert "broken failed (exit 1) after 1 restart(s)" in up.output, up.output
    log = (run_dir / "logs" / "broken.log").read_text()
    assert log.count("ImportError: heartbeat: its preload fails") == 2, log  # both starts
    assert "gRPC listening" not in log and "start gate" not in log, log
    assert_nothing_left(run_dir)
