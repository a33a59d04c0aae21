"""Chaos: SIGKILL the NATS server, the learner, an env server and an actor, in a random order
at random moments, during one CartPole PPO run through the whole fleet; once every kill has
been recovered from, the run is stopped in order (Ctrl-C) and every fragment the learner saw
must have been applied exactly once (no gap in any actor incarnation's sequence, no id applied
twice).

The run has no step budget to finish within: a fast machine trains CartPole at dozens of updates
a second, faster than kills and recoveries (seconds each) can be placed, so a fixed-length run
ended before its last kill had recovered. Each kill waits for the previous recovery instead.

The order and moments come from a seed printed with the result (RLFLEET_CHAOS_SEED replays one).
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import time
import uuid
from pathlib import Path

import pytest
import yaml

from tests.fixtures.launch import Up, assert_nothing_left, two_actor_cartpole
from tests.fixtures.runs import (
    UNBOUNDED_STEPS,
    applied_updates,
    audit_ledger,
    nats_pids,
    service_pids,
    stop_in_order,
)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(sys.platform != "linux", reason="scans /proc"),
]

SERVICES = ("env-0", "learner", "actor-0", "actor-1")
VICTIMS = ("nats", "learner", "env-0", "actor-0")


def chaos_config(tmp_path: Path, total_timesteps: int) -> tuple[Path, Path]:
    config = two_actor_cartpole()
    run_dir = tmp_path / "run"
    config["run"] = {"name": f"chaos-{uuid.uuid4().hex[:8]}", "dir": str(run_dir)}
    config["job"].update(total_timesteps=total_timesteps, target_return=None, update_epochs=4)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path, run_dir


def current_pid(run_dir: Path, victim: str) -> int:
    if victim == "nats":
        (pid,) = nats_pids(run_dir)
        return pid
    return service_pids(run_dir, victim)[-1]


@pytest.mark.timeout(720)
def test_random_kills_lose_and_double_nothing(tmp_path: Path) -> None:
    seed = int(os.environ.get("RLFLEET_CHAOS_SEED", time.time_ns() % 1_000_000))
    rng = random.Random(seed)
    order = rng.sample(VICTIMS, len(VICTIMS))
    config, run_dir = chaos_config(tmp_path, UNBOUNDED_STEPS)
    up = Up(config, run_dir, services=SERVICES, budget_s=600)
    faults: list[str] = []
    try:
        for i, victim in enumerate(order):
            # Kill i falls in its own window of updates, after the previous kill's recovery.
            at = max(4 + 25 * i + rng.randint(0, 8), applied_updates(run_dir) + 1)
            up.wait_until(f"update {at}", lambda at=at: applied_updates(run_dir) >= at)
            time.sleep(rng.uniform(0.0, 1.5))  # not always right after an update
            pid = current_pid(run_dir, victim)
            incarnations = audit_ledger(run_dir).incarnations
            os.kill(pid, signal.SIGKILL)
            killed_at = applied_updates(run_dir)
            faults.append(f"{victim} (pid {pid}) at update {killed_at}")

            # Recovered once training has gone two updates past the kill (after a learner
            # restart the ledger first rolls back to its checkpoint) and a killed actor's new
            # incarnation has had a fragment taken.
            def recovered(k: int = killed_at, v: str = victim, n: int = incarnations) -> bool:
                if applied_updates(run_dir) < k + 2:
                    return False
                return not v.startswith("actor") or audit_ledger(run_dir).incarnations > n

            up.wait_until(f"recovery from killing {victim}", recovered)
        # A few more updates on the recovered fleet, then the orderly stop.
        last = applied_updates(run_dir) + 5
        up.wait_until(f"update {last}", lambda: applied_updates(run_dir) >= last)
        audit = stop_in_order(up, run_dir)
        print(f"chaos seed {seed}: killed {'; '.join(faults)}; {audit}")
        if report := os.environ.get("RLFLEET_CHAOS_REPORT"):  # `make soak` collects these
            record = {"seed": seed, "faults": faults, "applied": audit.applied,
                      "lost": audit.lost, "doubled": audit.doubled}  # fmt: skip
            with open(report, "a") as out:
                out.write(json.dumps(record) + "\n")
        assert audit.lost == [] and audit.doubled == [], audit
        assert audit.applied > 0 and audit.incarnations >= 3  # actor-0 came back as a new one
        assert (run_dir / "final").is_dir()  # the stopped learner left its policy
        assert_nothing_left(run_dir)
    except BaseException:
        print(f"chaos seed {seed}, faults so far: {faults}")
        print(up.diagnostics())
        raise
    finally:
        up.stop()
