"""Scaling a run's env servers up and down while it trains, under the launcher.

`rlfleet up` trains CartPole PPO (two actors) with one env server, `env-0`. Mid-run two more
replicas of `env-0` join as an operator adds them on other machines (`rlfleet serve env_server
--name env-0` with the run's NATS url and name, nothing else): both actors spread their envs
over all three. Then one replica is stopped (it drains: the actors move off it before it
exits) and one is SIGKILLed (its envs move within seconds). The run finishes with every
fragment applied exactly once and no actor restarted.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import yaml

from tests.fixtures.launch import Up, assert_nothing_left, two_actor_cartpole
from tests.fixtures.runs import applied_updates, audit_ledger

pytestmark = [pytest.mark.slow]

SERVICES = ("env-0", "learner", "actor-0", "actor-1")
REPO = Path(__file__).resolve().parents[2]
UPDATES = 250  # long enough to scale up, drain and kill well before the end
STEPS_PER_UPDATE = 256  # two fragments of 4 envs x 32 steps


def sessions_on(log: Path, address: str) -> int:
    """Sessions an actor's log says it opened on ``address`` (its layout lines)."""
    text = log.read_text(errors="replace") if log.exists() else ""
    return len(re.findall(rf"envs \d+-\d+ on [^\n]*{re.escape(address)}", text))


@pytest.mark.timeout(600)
def test_env_servers_join_drain_and_die_while_a_run_trains(tmp_path: Path) -> None:
    config = two_actor_cartpole()
    run_dir = tmp_path / "run"
    run = f"scale-{uuid.uuid4().hex[:8]}"
    config["run"] = {"name": run, "dir": str(run_dir)}
    config["job"].update(
        total_timesteps=UPDATES * STEPS_PER_UPDATE, target_return=None, update_epochs=4
    )
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    up = Up(path, run_dir, services=SERVICES, budget_s=540)
    joined: dict[str, subprocess.Popen[bytes]] = {}
    try:
        up.wait_for(r"NATS at nats://\S+", 60)
        nats = re.search(r"NATS at (nats://\S+)", up.output)[1]  # type: ignore[index]
        up.wait_until("update 3", lambda: applied_updates(run_dir) >= 3)
        for replica in ("b", "c"):
            env = {
                **os.environ,
                "OMP_NUM_THREADS": "1",
                "RLFLEET_RUN_NAME": run,
                "RLFLEET_NATS_URL": nats,
                "RLFLEET_REPLICA_NAME": f"env-0#{replica}",
                "RLFLEET_LOG_LEVEL": "INFO",
            }
            log = (tmp_path / f"env-{replica}.log").open("w")
            joined[replica] = subprocess.Popen(
                [sys.executable, "-m", "services.serve", "env_server", "--name", "env-0"],
                cwd=REPO,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        addresses = {}
        for replica in ("b", "c"):

            def serving(r: str = replica) -> bool:
                text = (tmp_path / f"env-{r}.log").read_text(errors="replace")
                if found := re.search(r"serving on (\S+)", text):
                    addresses[r] = found[1]
                return bool(found)

            up.wait_until(f"replica {replica} serving", serving, timeout_s=60)
        actor_logs = [run_dir / "logs" / f"actor-{i}.log" for i in (0, 1)]
        up.wait_until(
            "both actors on all three replicas",
            lambda: all(
                sessions_on(log, addresses["b"]) and sessions_on(log, addresses["c"])
                for log in actor_logs
            ),
            timeout_s=60,
        )
        at_join = applied_updates(run_dir)

        # Scale down by one: a stop drains first, then the process exits 0.
        joined["b"].send_signal(signal.SIGTERM)
        assert joined["b"].wait(30) == 0
        drained = (tmp_path / "env-b.log").read_text(errors="replace")
        assert "draining:" in drained, drained[-3000:]
        # And one dies: its envs go to the replicas left.
        up.wait_until("a few updates", lambda: applied_updates(run_dir) >= at_join + 3)
        joined["c"].send_signal(signal.SIGKILL)
        joined["c"].wait(10)

        assert up.wait() == 0, "the run failed"
        assert "main service learner finished" in up.output
        for log in actor_logs:  # one incarnation each: the actors were never restarted
            text = log.read_text(errors="replace")
            assert text.count("loaded weights v") == 1, text[-3000:]
        audit = audit_ledger(run_dir)
        print(f"joined at update {at_join}; {audit}")
        assert audit.lost == [] and audit.doubled == [], audit
        assert audit.incarnations == 2
        assert audit.applied == 2 * applied_updates(run_dir)
        assert_nothing_left(run_dir)
    except BaseException:
        print(up.diagnostics())
        raise
    finally:
        for proc in joined.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
        up.stop()
