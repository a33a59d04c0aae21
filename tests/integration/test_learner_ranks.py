"""The learner with 2 DeepSpeed ranks through the fleet: `rlfleet up` of a PPO job with
``learner_ranks: 2`` (real nats-server, env server, actors; the learner process is rank 0 and
starts rank 1). Rank 0 is SIGKILLed once after its first checkpoint: the launcher restarts the
group, which resumes from the checkpoint. The run reaches a modest return, both ranks'
parameter digests (written at every checkpoint) are equal at the end, and the ledger names
every applied fragment once and accounts for exactly the final policy's env steps.
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
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.fixtures.launch import Up, assert_nothing_left, pids_mentioning, two_actor_cartpole

SERVICES = ("env-0", "learner", "actor-0", "actor-1")
TARGET = 150.0  # modest: CartPole's random policy scores about 22
RUN_TIMEOUT_S = 300.0

pytestmark = [pytest.mark.slow, pytest.mark.skipif(sys.platform != "linux", reason="/proc")]


def _config(tmp_path: Path) -> tuple[Path, Path]:
    config = two_actor_cartpole()
    run_dir = tmp_path / "run"
    config["run"] = {"name": f"ranks-{uuid.uuid4().hex[:8]}", "dir": str(run_dir)}
    config["job"].update(
        learner_ranks=2, target_return=TARGET, checkpoint_every=5, total_timesteps=150_000
    )
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path, run_dir


def _ledger(run_dir: Path) -> list[dict[str, Any]]:
    entries = []
    with contextlib.suppress(FileNotFoundError):
        for line in (run_dir / "learner" / "applied.jsonl").read_text().splitlines():
            with contextlib.suppress(ValueError):
                entries.append(json.loads(line))
    return [e for e in entries if e.get("status") == "applied"]


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _digests(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads((run_dir / "learner" / f"rank-{r}.json").read_text()) for r in (0, 1)]


@pytest.mark.timeout(RUN_TIMEOUT_S + 60)
def test_two_learner_ranks_train_cartpole_in_lockstep(tmp_path: Path) -> None:
    config, run_dir = _config(tmp_path)
    up = Up(config, run_dir, services=SERVICES, budget_s=RUN_TIMEOUT_S)
    try:
        up.wait_until("a checkpoint", lambda: (run_dir / "learner" / "rank-1.json").is_file())
        ranks = pids_mentioning("--name learner ", str(up.config_copy))
        assert len(ranks) == 2, f"learner processes (rank 0 and rank 1): {ranks}"
        rank0 = next(pid for pid in ranks if _parent(pid) not in ranks)  # it started rank 1
        os.kill(rank0, signal.SIGKILL)
        up.wait_until("the group restarted", lambda: "learner crashed" in up.output)

        assert up.wait() == 0, "the run failed"
        out = up.output
        assert "main service learner finished" in out
        assert re.search(r"learner\s+learner\s+exit 0\s+restarts 1", out)

        final = json.loads((run_dir / "final" / "policy.json").read_text())
        entries = _ledger(run_dir)
        counts = collections.Counter(e["id"] for e in entries)
        assert not {i: n for i, n in counts.items() if n > 1}, "fragments applied twice"
        assert len(entries) == 2 * final["updates"]  # fragments_per_update: 2
        assert sum(e["steps"] for e in entries) == final["global_step"]

        first, second = _digests(run_dir)
        assert (first["world"], second["world"]) == (2, 2)
        assert first["updates"] == second["updates"] == final["updates"]
        assert first["sha256"] == second["sha256"], "the ranks' parameters differ"

        assert final["global_step"] < 150_000  # ended by the target return, not the budget

        log = (run_dir / "logs" / "learner.log").read_text()
        assert log.count("rank 1 of 2 following rank 0") == 2  # both starts of the group
        assert "(restored)" in log  # the restarted group resumed from the checkpoint
        up.stop()
        assert_nothing_left(run_dir)
    except BaseException:
        print(up.diagnostics())
        raise
    finally:
        up.stop()
