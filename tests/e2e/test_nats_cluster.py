"""No single bus node: a CartPole PPO run on a 3-node JetStream cluster (`nats: {cluster: 3}`)
loses the leader of its trajectory stream to a SIGKILL mid-run; the launcher restarts that node
on its ports and store, the stream is led again with every copy current, training goes on, and
after the orderly stop every fragment the learner saw was applied exactly once (the ledger audit
of tests/fixtures/runs.py, as in the chaos test).
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
import uuid
from pathlib import Path

import pytest
import yaml

from services.bus import stream_name
from tests.fixtures.launch import Up, assert_nothing_left, pids_mentioning, two_actor_cartpole
from tests.fixtures.nats import stream_state
from tests.fixtures.runs import UNBOUNDED_STEPS, applied_updates, stop_in_order

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(sys.platform != "linux", reason="scans /proc"),
]

SERVICES = ("env-0", "learner", "actor-0", "actor-1")
KILL_AT = 6  # updates applied before the kill: the stream, its consumer and the actors are busy


def cluster_config(tmp_path: Path) -> tuple[Path, Path, str]:
    config = two_actor_cartpole()
    run_dir = tmp_path / "run"
    name = f"cluster-{uuid.uuid4().hex[:8]}"
    config["run"] = {"name": name, "dir": str(run_dir)}
    config["nats"] = {"cluster": 3}
    config["job"].update(total_timesteps=UNBOUNDED_STEPS, target_return=None, update_epochs=4)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path, run_dir, name


def node_pids(run_dir: Path, server_name: str) -> list[int]:
    """The nats-server of one cluster node of the run (its store dir names it)."""
    return pids_mentioning("nats-server", f"-sd {run_dir / 'nats' / server_name} ")


@pytest.mark.timeout(720)
def test_a_run_survives_sigkill_of_its_stream_leader_node(tmp_path: Path) -> None:
    config, run_dir, run = cluster_config(tmp_path)
    stream = stream_name(run)
    up = Up(config, run_dir, services=SERVICES, budget_s=600)
    try:
        up.wait_for(r"NATS at \S+ \(3-node JetStream cluster, 3 replicas\)", 60)
        line = next(line for line in up.lines if "NATS at " in line)
        url = line.split("NATS at ")[1].split(" ")[0]
        assert len(url.split(",")) == 3
        up.wait_until(f"update {KILL_AT}", lambda: applied_updates(run_dir) >= KILL_AT)
        leader, replicas, _ = asyncio.run(stream_state(url, stream))
        assert replicas == 3  # the learner made the stream with the launcher's replica count
        (pid,) = node_pids(run_dir, leader)
        os.kill(pid, signal.SIGKILL)
        killed_at = applied_updates(run_dir)
        up.wait_for(rf"nats-server {leader} exited \(SIGKILL\); restart 1/5", 30)
        up.wait_for(rf"nats-server {leader} up again at nats://127\.0\.0\.1:\d+", 60)
        (new_pid,) = node_pids(run_dir, leader)
        assert new_pid != pid
        # The stream is led again (by a survivor, or by the restarted node if it came back
        # before the survivors elected one) and the restarted node is a current copy again.
        deadline = time.monotonic() + 60
        while not all((state := asyncio.run(stream_state(url, stream)))[2].values()):
            assert time.monotonic() < deadline, f"a copy never caught up: {state}"
            time.sleep(0.5)
        assert set(state[2]) | {state[0]} == {"nats-0", "nats-1", "nats-2"}, state
        up.wait_until("training past the kill", lambda: applied_updates(run_dir) >= killed_at + 3)
        audit = stop_in_order(up, run_dir)
        print(f"killed {leader} (pid {pid}) at update {killed_at}; {audit}")
        assert audit.lost == [] and audit.doubled == [], audit
        assert audit.applied > 2 * killed_at  # training went on after the kill
        assert (run_dir / "final").is_dir()  # the stopped learner left its policy
        assert_nothing_left(run_dir)
    except BaseException:
        print(up.diagnostics())
        raise
    finally:
        up.stop()
