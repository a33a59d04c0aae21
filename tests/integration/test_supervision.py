"""Supervision beyond a crashing service (issue 13): the embedded nats-server is supervised like
a service, no child outlives a SIGKILLed launcher, and a service that fails for a reason a
restart cannot heal exits EXIT_PERMANENT and fails the run at once, with its one-line reason.

Real processes throughout: `python -m launch.cli up` in a subprocess (tests/fixtures/launch.py),
the real nats-server, real `heartbeat` services, and for the NATS-kill case a short CartPole PPO
run (examples/cartpole_ppo.yaml shrunk) through the whole fleet.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest
import yaml

from services.errors import EXIT_PERMANENT
from tests.fixtures.launch import Up, assert_nothing_left, pids_mentioning, two_actor_cartpole
from tests.fixtures.launch import write_config as launch_config
from tests.fixtures.runs import applied_updates, nats_pids, service_pids

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="scans /proc")

REPO = Path(__file__).resolve().parents[2]
PPO_SERVICES = ("env-0", "learner", "actor-0", "actor-1")


def write_config(tmp_path: Path, services: str) -> tuple[Path, Path]:
    return launch_config(tmp_path, services, name="sup")


def wait_gone(run_dir: Path, pids: list[int], timeout_s: float) -> list[int]:
    """The pids of ``pids`` still alive (and of this run) after up to ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while (left := set(pids) & set(pids_mentioning(str(run_dir)))) and (
        time.monotonic() < deadline
    ):
        time.sleep(0.1)
    return sorted(left)


def test_children_die_with_a_sigkilled_launcher(tmp_path: Path) -> None:
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
    up = Up(config, run_dir)
    try:
        up.wait_for(r"\[metrics\] service=hb-b")
        nats = nats_pids(run_dir)
        services = service_pids(run_dir, "hb-a") + service_pids(run_dir, "hb-b")
        assert len(nats) == 1 and len(services) == 2, (nats, services)
        up.proc.kill()  # SIGKILL: the launcher runs no cleanup at all
        up.proc.wait(10)
        # nats-server gets SIGKILL from the kernel at once; services a SIGTERM (graceful stop).
        assert wait_gone(run_dir, nats, 3) == [], "nats-server outlived the launcher"
        assert wait_gone(run_dir, services, 8) == [], "services outlived the launcher"
        assert_nothing_left(run_dir)
    finally:
        up.stop()


def test_permanent_failure_is_not_restarted_and_fails_with_its_reason(tmp_path: Path) -> None:
    # The launcher validated a good config; the copy the service reads at start has a bad
    # setting (as when a setting only the service's host rejects), so it fails for good.
    good, run_dir = write_config(
        tmp_path,
        """\
        - name: hb-main
          service: heartbeat
          main: true
          restarts: 3
          settings: {interval_s: 0.2}
        """,
    )
    bad = tmp_path / "bad.yaml"
    bad.write_text(good.read_text().replace("interval_s: 0.2", "interval_s: -1"))
    script = textwrap.dedent(
        f"""
        import sys
        from services.config import load_run_config
        from launch.launcher import Launcher
        sys.exit(Launcher(load_run_config({str(good)!r}), {str(bad)!r}).run())
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        cwd=REPO,
    )
    out = result.stdout
    assert result.returncode == 1, out + result.stderr
    reason = (
        "hb-main (heartbeat): ConfigError: "
        f"{run_dir / 'config.yaml'}:9: services[0].settings.interval_s: Input should be greater"
    )
    assert f"hb-main failed permanently (exit {EXIT_PERMANENT}, not restarted): {reason}" in out
    assert "restart 1/3" not in out
    assert re.search(rf"hb-main\s+heartbeat\s+exit {EXIT_PERMANENT}\s+restarts 0", out), out
    log = (run_dir / "logs" / "hb-main.log").read_text()
    assert f"rlfleet: permanent failure: {reason}" in log
    assert "Traceback" not in log
    assert len(service_pids(run_dir, "hb-main")) == 1  # started once
    assert_nothing_left(run_dir)


class _RunsCode:
    """Unpickling it would run a shell command (touch ``marker``)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.slow
def test_a_poisoned_checkpoint_fails_the_learner_once_in_one_line(tmp_path: Path) -> None:
    """A checkpoint that pickles code is refused (learner/safe_load.py) as a permanent failure:
    it used to be an UnpicklingError traceback, restarted three times to the same end."""
    import torch

    config, run_dir = launch_config(
        tmp_path,
        """\
        - name: learner
          service: learner
          restarts: 3
          settings: {env_id: CartPole-v1, device: cpu, policy: {hidden_sizes: [8]}}
        """,
    )
    tag = run_dir / "checkpoints" / "update-00000003"
    tag.mkdir(parents=True)
    poisoned = tag / "mp_rank_00_model_states.pt"
    marker = tmp_path / "code-ran"
    torch.save({"module": {}, "x": _RunsCode(marker)}, poisoned)
    (run_dir / "checkpoints" / "latest").write_text(tag.name)
    result = subprocess.run(
        [sys.executable, "-m", "launch.cli", "up", str(config)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        cwd=REPO,
    )
    out = result.stdout
    assert result.returncode == 1, out + result.stderr
    reason = (
        f"learner (learner): ConfigError: {poisoned}: refusing to load, it pickles posix.system"
    )
    assert f"learner failed permanently (exit {EXIT_PERMANENT}, not restarted): {reason}" in out
    assert "restart 1/3" not in out
    log = (run_dir / "logs" / "learner.log").read_text()
    assert log.count("rlfleet: permanent failure:") == 1
    assert f"rlfleet: permanent failure: {reason}\n" in log
    assert "Traceback" not in log
    assert len(service_pids(run_dir, "learner")) == 1  # started once
    assert not marker.exists()
    assert_nothing_left(run_dir)


def test_serve_exits_permanent_with_one_line_on_invalid_argument(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """An InvalidArgument out of a service's main (a payload that can never fit the bus), even
    inside an exception group, is permanent; any other exception stays a restartable exit 1."""
    import services.registry
    from launch.cli import main
    from services.builtin import HeartbeatSettings
    from services.errors import InvalidArgument
    from services.registry import ServiceSpec
    from services.serve import ENV_EXIT_REASON

    failure: list[BaseException] = []

    async def fail(ctx: object) -> None:
        raise failure[0]

    spec = ServiceSpec(kind="heartbeat", settings=HeartbeatSettings, main=fail, grpc=False)
    monkeypatch.setattr(services.registry, "get_service", lambda kind: spec)
    monkeypatch.delenv("RLFLEET_LAUNCHER_PID", raising=False)
    monkeypatch.setenv(ENV_EXIT_REASON, str(tmp_path / "reason"))
    too_big = InvalidArgument("Fragment is 9000000 bytes,\nover the server's max payload")
    failure[:] = [ExceptionGroup("tasks", [too_big])]
    assert main(["serve", "heartbeat", "--name", "hb"]) == EXIT_PERMANENT
    line = "hb (heartbeat): InvalidArgument: Fragment is 9000000 bytes, | over the server's max"
    assert capsys.readouterr().err.startswith(f"rlfleet: permanent failure: {line}")
    assert (tmp_path / "reason").read_text().startswith(line)
    failure[:] = [RuntimeError("transient")]
    assert main(["serve", "heartbeat", "--name", "hb"]) == 1


def test_nats_is_restarted_on_its_port_then_bounded(tmp_path: Path) -> None:
    config, run_dir = write_config(
        tmp_path,
        """\
        - name: hb-a
          service: heartbeat
          settings: {interval_s: 0.2}
        """,
    )
    config.write_text(config.read_text().replace("services:\n", "nats: {restarts: 1}\nservices:\n"))
    up = Up(config, run_dir)
    try:
        up.wait_for(r"\[metrics\] service=hb-a")
        (first,) = nats_pids(run_dir)
        os.kill(first, signal.SIGKILL)
        up.wait_for(r"nats-server up again at nats://127\.0\.0\.1:\d+ \(pid \d+\)")
        assert "nats-server exited (SIGKILL); restart 1/1" in up.output
        seen = up.output.count("[metrics] service=hb-a")
        # The client reconnects by itself: heartbeats flow again through the new server.
        deadline = time.monotonic() + 20
        while up.output.count("[metrics] service=hb-a") < seen + 3:
            assert time.monotonic() < deadline, up.output
            time.sleep(0.1)
        (second,) = nats_pids(run_dir)
        assert second != first
        os.kill(second, signal.SIGKILL)
        assert up.wait(30) == 1, up.output
        assert "nats-server failed (SIGKILL) after 1 restart(s)" in up.output
        assert_nothing_left(run_dir)
    finally:
        up.stop()


# --- NATS killed in the middle of a PPO run ----------------------------------------------------


def ppo_config(tmp_path: Path, total_timesteps: int) -> tuple[Path, Path]:
    config = two_actor_cartpole()
    run_dir = tmp_path / "run"
    config["run"] = {"name": f"sup-{uuid.uuid4().hex[:8]}", "dir": str(run_dir)}
    config["job"].update(total_timesteps=total_timesteps, target_return=None, update_epochs=4)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path, run_dir


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_ppo_run_survives_nats_sigkill(tmp_path: Path) -> None:
    total = 8_000  # 256 transitions per update: ~31 updates
    config, run_dir = ppo_config(tmp_path, total)
    up = Up(config, run_dir, services=PPO_SERVICES, budget_s=480)
    try:
        up.wait_until("3 learner updates", lambda: applied_updates(run_dir) >= 3)
        (nats,) = nats_pids(run_dir)
        os.kill(nats, signal.SIGKILL)
        killed_at = applied_updates(run_dir)
        assert up.wait() == 0, "the run failed"
        out = up.output
        assert "nats-server exited (SIGKILL); restart 1/5" in out
        assert "nats-server up again at nats://127.0.0.1:" in out
        assert "main service learner finished" in out
        final = json.loads((run_dir / "final" / "policy.json").read_text())
        assert final["global_step"] >= total
        assert applied_updates(run_dir) > killed_at  # training went on after the restart
        ports = re.findall(r"-p (\d+) -js", (run_dir / "nats" / "nats-server.log").read_text())
        assert len(ports) == 2 and ports[0] == ports[1], ports  # same port for the clients
        assert_nothing_left(run_dir)
    except BaseException:
        print(up.diagnostics())
        raise
    finally:
        up.stop()
