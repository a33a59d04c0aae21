"""End to end: `rlfleet up` on (a copy of) examples/agent_guess.yaml, the real fleet in
subprocesses: an env server serving GuessNumber-v0's episodes, a sampler (transformers, as the
example), a rollout driver playing groups of episodes turn by turn, the LM learner training on
them, warm-started on the env's expert demonstrations and evaluated on its held-out episodes.
Mid-run the env server is SIGKILLed: the groups it held are dropped and counted, their tasks
played again once the launcher has restarted it, and the learner applies every group once.
"""

from __future__ import annotations

import collections
import json
import os
import signal
import sys
import uuid
from pathlib import Path

import pytest
import yaml

from tests.fixtures.launch import Up, assert_nothing_left
from tests.fixtures.runs import applied_updates, ledger_entries, service_pids

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "agent_guess.yaml"
SERVICES = ("reward", "learner", "sampler-0", "env-0", "rollout-0")
UPDATES = 4
KILL_AT = 1  # updates applied before the env server is killed

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(sys.platform != "linux", reason="scans /proc"),
]


def rollout_metrics(run_dir: Path) -> list[dict[str, float]]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["values"] for r in records if r.get("service") == "rollout-0"]


@pytest.mark.timeout(900)
def test_an_agent_run_trains_on_episodes_and_survives_its_env_server_killed(
    tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The drivers' metrics each second: the run may be shorter than the default interval, and its
    # episodes' outcomes must not hang on the one report a driver sends as it stops.
    monkeypatch.setenv("RLFLEET_ROLLOUT__METRICS_INTERVAL_S", "1")
    config = yaml.safe_load(EXAMPLE.read_text())
    run_dir = tmp_path / "run"
    config["run"] = {"name": f"e2e-agent-{uuid.uuid4().hex[:8]}", "dir": str(run_dir)}
    config["job"].update(
        model_path=str(tiny_model_dir), total_updates=UPDATES, groups_per_update=4, group_size=4
    )
    config["job"]["env"]["max_turns"] = 3  # shorter episodes: the same machinery, sooner
    # Room for the driver to run ahead of the learner, so pacing never pauses it: groups are in
    # flight whenever the env server is killed.
    config["job"]["max_policy_lag"] = 8
    # The learner's own episodes on the same env server: SFT on demonstrations, evaluations.
    config["job"].update(sft_steps=3, sft_batch_size=8, eval_count=8, eval_every=2)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    up = Up(path, run_dir, services=SERVICES, budget_s=780)
    try:
        up.wait_until(f"update {KILL_AT}", lambda: applied_updates(run_dir) >= KILL_AT)
        (pid,) = service_pids(run_dir, "env-0")
        os.kill(pid, signal.SIGKILL)
        killed_at = applied_updates(run_dir)
        up.wait_for(r"env-0 .*restart 1/", 60)
        # Training goes on within seconds (a dropped group must not hold the driver's pacing).
        up.wait_until("an update past the kill", lambda: applied_updates(run_dir) > killed_at, 90)
        assert up.wait() == 0, "the run failed"
        assert "main service learner finished" in up.output
    except BaseException:
        print(up.diagnostics())
        raise
    finally:
        up.stop()
    try:  # what the run left behind; the logs say why when it is wrong
        ledger = [e for e in ledger_entries(run_dir) if e["status"] == "applied"]
        counts = collections.Counter(e["id"] for e in ledger)
        assert not [i for i, n in counts.items() if n > 1]  # no group applied twice
        assert max(e["update"] for e in ledger) == UPDATES
        metrics = rollout_metrics(run_dir)
        outcomes = {
            k for m in metrics for k in m if k.startswith("episodes/") and k.endswith("_frac")
        }
        assert outcomes, metrics  # episodes ended, each with its outcome
        assert sum(m.get("episodes/dropped", 0.0) for m in metrics) > 0  # the kill's groups
        learner = [
            json.loads(line)["values"]
            for line in (run_dir / "metrics.jsonl").read_text().splitlines()
            if '"service": "learner"' in line
        ]
        assert any(v.get("rollout/completion_tokens", 0) > 0 for v in learner)
        assert "learner: fetching 24 demonstrations of GuessNumber-v0" in up.output
        evals = [
            json.loads(line)
            for line in (run_dir / "learner" / "eval.jsonl").read_text().splitlines()
        ]
        assert evals[0]["eval/version"] == 0 and evals[-1]["eval/update"] == UPDATES
        # Each evaluation keeps its first answers (the studio shows them): whole transcripts here.
        samples = (run_dir / "learner" / "eval_samples.jsonl").read_text().splitlines()
        assert len(samples) == len(evals)
        latest = json.loads(samples[-1])
        assert latest["update"] == UPDATES and 0 < len(latest["samples"]) <= 8
        assert all(s["messages"][0]["role"] in ("system", "user") for s in latest["samples"])
        for record in evals:
            assert 0 <= record["eval/accuracy"] <= 1
            fractions = [v for k, v in record.items() if k.endswith("_frac")]
            assert abs(sum(fractions) - 1) < 1e-6  # every evaluated episode ended one way
        assert_nothing_left(run_dir)
    except AssertionError:
        print(up.diagnostics())
        raise
