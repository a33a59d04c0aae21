"""bench/game/ppo_cartpole.py's parsing and target marking (no runs: fakes of the programs'
output)."""

from __future__ import annotations

import sys
from pathlib import Path

import yaml

from bench.game import ppo_cartpole_report as report
from bench.game import ppo_cartpole_runs as runs

ROOT = Path(__file__).resolve().parents[2]


def test_actor_start_lines_give_first_step_and_transport(tmp_path: Path) -> None:
    (tmp_path / "actor-0.log").write_text(
        "=== 2026-12-01 17:16:31 start 1 pid 1: python -m launch.cli serve game_actor\n"
        "2026-12-01 17:16:38,177 INFO actor-0 sampler.actors.actor: loaded weights v0\n"
        "2026-12-01 17:16:38,178 INFO actor-0 sampler.actors.actor: actor actor-0: 4 x "
        "CartPole-v1 over 127.0.0.1:45665 (steps via shm), policy learner, T=32, fragments on\n"
    )
    (tmp_path / "actor-1.log").write_text(
        "2026-12-01 17:16:37,500 INFO actor-1 sampler.actors.actor: actor actor-1: 4 x "
        "CartPole-v1 over 127.0.0.1:45665,127.0.0.1:1 (steps via grpc,grpc, double-buffered), "
        "policy learner, T=32, fragments on\n"
    )
    first, transports = runs._actor_starts(tmp_path)
    assert transports == ["shm", "grpc"]
    assert first == _ts("37,500")  # the earliest actor's


def _ts(sec: str) -> float:
    from datetime import datetime

    return datetime.strptime(f"2026-12-01 17:16:{sec}", "%Y-%m-%d %H:%M:%S,%f").timestamp()


def test_variant_keeps_the_batch_of_the_baseline() -> None:
    config = yaml.safe_load((ROOT / "examples" / "cartpole_ppo.yaml").read_text())
    cfg = runs.variant(config, 4, 64, colocated="off", total_timesteps=1000)
    job = cfg["job"]
    assert (job["num_actors"], job["num_envs"], job["fragments_per_update"]) == (4, 16, 4)
    assert job["env_server"] == {"colocated": "off"} and job["total_timesteps"] == 1000
    args = runs.baseline_args(job, seed=3)
    assert args.num_envs == 64 and args.batch_size == 64 * job["rollout_length"]
    assert args.num_minibatches == args.batch_size // job["minibatch_size"]
    assert config["job"]["num_actors"] == 1  # the original is untouched


def test_compare_run_reads_the_printed_lines(tmp_path: Path) -> None:
    """A fake CleanRL: 30 episodes of 500 after one update; stopped at the 20th."""
    fake = tmp_path / "fake.py"
    fake.write_text(
        "import time\n"
        "print('SPS: 1000', flush=True)\n"
        "for i in range(30):\n"
        "    print(f'global_step={300 + i}, episodic_return=[500.]', flush=True)\n"
        "    time.sleep(0.01)\n"
        "time.sleep(30)\n"
    )
    job = yaml.safe_load((ROOT / "examples" / "cartpole_ppo.yaml").read_text())["job"]
    old = runs.ENVPOOL_SCRIPT
    runs.ENVPOOL_SCRIPT = fake
    try:
        out = runs.compare_run("envpool", Path(sys.executable), job, 1, tmp_path, 20)
    finally:
        runs.ENVPOOL_SCRIPT = old
    assert out["reached_target_at_step"] == 319
    assert out["time_to_target_s"] is not None and out["time_to_target_s"] > 0.2  # one batch
    assert out["sps_printed"] == 1000 and not out["timed_out"]


def _side(sps: float, t: float | None) -> dict:
    return {"sps": sps, "time_to_target_s": t, "time_to_target_from_launch_s": t and t + 20,
            "reached_target_at_step": 1 if t else None, "startup_s": 20.0}  # fmt: skip


def test_targets_are_marked_per_seed() -> None:
    rows = [
        {"seed": 1, "baseline": _side(1000, 30.0), "system": _side(1200, 25.0)},
        {"seed": 2, "baseline": _side(1000, 30.0), "system": _side(900, 29.0)},
        {"seed": 3, "baseline": _side(1000, 30.0), "system": {"error": "RuntimeError: boom"}},
    ]
    s = report.summarize({"rows": rows})
    assert s["targets"]["sps"]["per_seed"] == [True, False, False]
    assert s["targets"]["time_to_target"]["per_seed"] == [True, True, False]
    assert s["targets"]["time_to_target_from_launch"]["per_seed"] == [False, False, False]
    assert s["targets"]["sps"]["count"] == "1/3" and not s["targets"]["sps"]["met"]
    assert s["sps_ratio_median"] == 1.05  # of the two that ran
    assert s["system_reached"] == 2
