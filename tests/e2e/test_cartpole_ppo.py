"""End to end: `rlfleet up` on (a copy of) examples/cartpole_ppo.yaml, the real fleet in
subprocesses: embedded nats-server, env-0, the DeepSpeed learner (main), actor-0 and actor-1.

1. The run learns CartPole: the learner's TensorBoard `charts/episodic_return` reaches 475, the
   run ends by itself (exit 0) with the final policy saved, the ledger names every applied
   fragment once, and no process of the run is left.
2. An actor SIGKILLed mid-run is restarted by the launcher under a new incarnation, the learner
   keeps applying fragments of both actors, and no fragment is applied twice.

Each run lives in tmp_path under a unique run name; "no process left" is checked by scanning
/proc for command lines that mention the run directory (services get `--config <run
dir>/config.yaml`, the embedded nats-server its store dir inside it). Timeouts are generous: a
loaded machine makes a run slower, not a failure.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import re
import signal
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.fixtures.launch import (
    CARTPOLE_EXAMPLE,
    Up,
    assert_nothing_left,
    pids_mentioning,
    two_actor_cartpole,
)

SERVICES = ("env-0", "learner", "actor-0", "actor-1")  # actor-1 with two actors
TARGET = 475.0
MAX_STEPS = 300_000
RUN_TIMEOUT_S = 420.0  # a run takes 1-2 minutes on 2 idle cores

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(sys.platform != "linux", reason="scans /proc"),
]


# --- helpers -----------------------------------------------------------------------------------


def write_config(tmp_path: Path, *, two_actors: bool = False, **job: Any) -> tuple[Path, Path, str]:
    """The example (with ``two_actors``: ``two_actor_cartpole``) with a unique run name, its run
    dir in tmp_path, and ``job`` overrides."""
    config = two_actor_cartpole() if two_actors else yaml.safe_load(CARTPOLE_EXAMPLE.read_text())
    name = f"e2e-ppo-{uuid.uuid4().hex[:8]}"
    run_dir = tmp_path / "run"
    config["run"] = {"name": name, "dir": str(run_dir)}
    config["job"].update({"seed": 1, **job})
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path, run_dir, name


def ledger(run_dir: Path) -> list[dict[str, Any]]:
    """The learner's applied.jsonl (a partly written last line is skipped)."""
    entries = []
    with contextlib.suppress(FileNotFoundError):
        for line in (run_dir / "learner" / "applied.jsonl").read_text().splitlines():
            with contextlib.suppress(ValueError):
                entries.append(json.loads(line))
    return entries


def applied(run_dir: Path) -> list[dict[str, Any]]:
    return [e for e in ledger(run_dir) if e.get("status") == "applied"]


def fragment_parts(fragment_id: str) -> tuple[str, str, str, int]:
    """``<run>/<actor>/<incarnation>/<seq>``."""
    run, actor, incarnation, seq = fragment_id.split("/")
    return run, actor, incarnation, int(seq)


@contextlib.contextmanager
def launched(config: Path, run_dir: Path) -> Iterator[Up]:
    """The run; on any failure inside the block, print the launcher's output and the tail of
    every service log (pytest shows them with the failure), and leave no process behind."""
    up = Up(config, run_dir, services=SERVICES, budget_s=RUN_TIMEOUT_S)
    try:
        yield up
    except BaseException:
        print(up.diagnostics())
        raise
    finally:
        up.stop()


def assert_applied_once(entries: list[dict[str, Any]]) -> None:
    counts = collections.Counter(e["id"] for e in entries)
    twice = {fid: n for fid, n in counts.items() if n > 1}
    assert not twice, f"fragments applied more than once: {twice}"


def episodic_returns(run_dir: Path) -> list[tuple[int, float]]:
    """(global step, value) of every `charts/episodic_return` point the learner wrote."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    accumulator.Reload()
    return [(e.step, e.value) for e in accumulator.Scalars("charts/episodic_return")]


# --- the tests ---------------------------------------------------------------------------------


@pytest.mark.timeout(RUN_TIMEOUT_S + 90)
def test_cartpole_learns_through_the_launcher(tmp_path: Path) -> None:
    """The example as it ships (one actor of 8 envs)."""
    job = yaml.safe_load(CARTPOLE_EXAMPLE.read_text())["job"]
    config, run_dir, name = write_config(tmp_path)
    with launched(config, run_dir) as up:
        assert up.wait() == 0, "the run failed"
        out = up.output
        assert "main service learner finished" in out
        assert re.search(r"learner\s+learner\s+exit 0\s+restarts 0", out)

        points = episodic_returns(run_dir)
        reached = [(step, value) for step, value in points if value >= TARGET]
        best = max(points, key=lambda p: p[1], default=None)
        assert reached, f"episodic_return never reached {TARGET:g} (best: {best})"
        step, value = reached[0]
        assert step <= MAX_STEPS, f"reached {value:g} only at step {step}"

        final = json.loads((run_dir / "final" / "policy.json").read_text())
        assert (run_dir / "final" / "policy.pt").stat().st_size > 0
        assert final["env_id"] == "CartPole-v1" and final["algo"] == "ppo"
        assert final["global_step"] <= MAX_STEPS  # ended by the target, not the step budget

        # The ledger accounts for exactly what the final weights contain.
        entries = applied(run_dir)
        assert entries
        assert_applied_once(entries)
        assert len(entries) == job["fragments_per_update"] * final["updates"]
        assert sum(e["steps"] for e in entries) == final["global_step"]
        actors = {fragment_parts(e["id"])[:2] for e in entries}
        assert actors == {(name, f"actor-{i}") for i in range(job["num_actors"])}

        assert_nothing_left(run_dir)
    print(f"reached {value:g} at step {step}; ended at step {final['global_step']}")


@pytest.mark.timeout(RUN_TIMEOUT_S + 90)
def test_actor_sigkill_is_restarted_and_run_continues(tmp_path: Path) -> None:
    total = 40_000
    config, run_dir, name = write_config(
        tmp_path, two_actors=True, target_return=None, total_timesteps=total
    )
    with launched(config, run_dir) as up:
        # A few updates in, with fragments of actor-0 among them.
        def warmed_up() -> bool:
            entries = applied(run_dir)
            actor_0 = any(fragment_parts(e["id"])[1] == "actor-0" for e in entries)
            return actor_0 and max((e["update"] for e in entries), default=0) >= 5

        up.wait_until("5 learner updates", warmed_up)
        actor_0 = pids_mentioning("--name actor-0 ", str(up.config_copy))
        assert len(actor_0) == 1, f"actor-0 processes: {actor_0}"
        os.kill(actor_0[0], signal.SIGKILL)
        # Every update past this one was made after the kill.
        killed_at = max(e["update"] for e in applied(run_dir))
        old = {
            fragment_parts(e["id"])[2]
            for e in applied(run_dir)
            if fragment_parts(e["id"])[1] == "actor-0"
        }
        assert len(old) == 1, old

        assert up.wait() == 0, "the run failed"
        out = up.output
        assert "main service learner finished" in out
        assert "actor-0 crashed (SIGKILL); restart 1/3" in out
        assert re.search(r"actor-0\s+game_actor\s+.+\s+restarts 1\s", out)
        assert re.search(r"actor-1\s+game_actor\s+.+\s+restarts 0\s", out)
        assert re.search(r"learner\s+learner\s+exit 0\s+restarts 0", out)

        log = (run_dir / "logs" / "actor-0.log").read_text()
        headers = re.findall(r"^=== \S+ \S+ start (\d+) pid (\d+): ", log, re.MULTILINE)
        assert [start for start, _ in headers] == ["1", "2"], headers
        assert int(headers[0][1]) == actor_0[0]

        entries = applied(run_dir)
        assert_applied_once(entries)
        final = json.loads((run_dir / "final" / "policy.json").read_text())
        assert final["global_step"] >= total
        assert len(entries) == 2 * final["updates"]
        assert sum(e["steps"] for e in entries) == final["global_step"]

        parts = [(fragment_parts(e["id"]), e["update"]) for e in entries]
        assert {run for (run, *_), _ in parts} == {name}
        incarnations = {inc for (_, actor, inc, _), _ in parts if actor == "actor-0"}
        new = incarnations - old
        assert len(new) == 1, f"actor-0 incarnations {incarnations}, before the kill {old}"
        (new_incarnation,) = new
        after = [(actor, inc) for (_, actor, inc, _), update in parts if update > killed_at]
        assert ("actor-0", new_incarnation) in after, "no fragment of the restarted actor-0"
        assert any(actor == "actor-1" for actor, _ in after), "no fragment of actor-1 after"

        assert_nothing_left(run_dir)
