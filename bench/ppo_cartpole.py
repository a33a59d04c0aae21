"""The full system versus single-process PPO on CartPole-v1, same hyperparameters, same run.

For each seed, in alternation (so background load hits every side alike):
- baseline: ``bench/ppo_baseline.py``'s CleanRL-style PPO (one process, ``SyncVectorEnv``);
- system: ``rlfleet up`` on ``examples/cartpole_ppo.yaml`` (embedded NATS, an env server, two
  actors, the DeepSpeed learner as separate processes) with the same hyperparameters;
- appo: the same fleet on ``examples/cartpole_appo.yaml`` (job kind ``appo``: V-trace targets,
  the clipped surrogate on V-trace advantages, fragments up to 4 versions old corrected).
All stop at a mean return of 475 over the last 20 episodes (or the step budget). Reported per
seed: env steps and wall time to 475 and env steps/s; the system's time is split into start-up
(launch to the learner's first update) and training, since start-up is a fixed cost. With
``--profile-updates`` the JSON also gets ``bench/ppo_update_profile.py``'s per-phase times of
one learner update of each job (in this process, before the runs).

    python bench/ppo_cartpole.py --seeds 1 2 3 [--profile-updates 40]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
if not __package__:
    sys.path.insert(0, str(ROOT))

from bench.ppo_baseline import PPOArgs, run_baseline  # noqa: E402

EXAMPLE = ROOT / "examples" / "cartpole_ppo.yaml"
APPO_EXAMPLE = ROOT / "examples" / "cartpole_appo.yaml"
TARGET = 475.0


def _baseline_args(job: dict[str, Any], seed: int) -> PPOArgs:
    """The example's hyperparameters in the baseline's terms (one env pool of the same size)."""
    batch = job["fragments_per_update"] * job["rollout_length"] * job["num_envs"]
    return PPOArgs(
        seed=seed,
        num_envs=batch // job["rollout_length"],
        rollout_length=job["rollout_length"],
        total_timesteps=job["total_timesteps"],
        learning_rate=job["learning_rate"],
        anneal_lr=job["anneal_lr"],
        gamma=job["gamma"],
        gae_lambda=job["gae_lambda"],
        num_minibatches=batch // job["minibatch_size"],
        update_epochs=job["update_epochs"],
        clip_coef=job["clip_coef"],
        clip_vloss=job["clip_vloss"],
        ent_coef=job["ent_coef"],
        target_return=TARGET,
    )


def _scalars(tb_dir: Path, tag: str) -> list[tuple[float, int, float]]:
    """(wall time, step, value) of one TensorBoard scalar tag, in step order."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0})
    acc.Reload()
    if tag not in acc.Tags().get("scalars", []):
        return []
    return [(e.wall_time, e.step, e.value) for e in acc.Scalars(tag)]


def run_system(config: dict[str, Any], seed: int, work: Path, kind: str = "ppo") -> dict[str, Any]:
    name = f"bench-{kind}-{seed}"
    config = json.loads(json.dumps(config))
    config["run"] = {"name": name, "dir": str(work / name)}
    config["job"].update(seed=seed, target_return=TARGET)
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    started = time.time()
    proc = subprocess.run(
        [sys.executable, "-m", "services.cli", "up", str(path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    wall = time.time() - started
    if proc.returncode != 0:
        raise RuntimeError(f"system run failed ({proc.returncode}):\n{proc.stdout[-3000:]}")
    returns = _scalars(work / name / "tensorboard", "charts/episodic_return")
    if not returns:
        raise RuntimeError(f"no charts/episodic_return in {work / name / 'tensorboard'}")
    first_update = returns[0][0]
    reached = next(((t, step) for t, step, v in returns if v >= TARGET), None)
    last_time, last_step, last_value = returns[-1]
    train_s = max(last_time - first_update, 1e-9)
    return {
        "steps": last_step,
        "wall_s": wall,
        "startup_s": first_update - started,
        "train_s": train_s,
        "sps": last_step / train_s,
        "reached_target_at_step": reached[1] if reached else None,
        "reached_target_wall_s": (reached[0] - started) if reached else None,
        "reached_target_train_s": (reached[0] - first_update) if reached else None,
        "final_mean_return": last_value,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--out", type=Path, default=ROOT / "bench/results/ppo_cartpole.json")
    parser.add_argument("--config", type=Path, default=EXAMPLE, help="a ppo job run file")
    parser.add_argument("--appo-config", type=Path, default=APPO_EXAMPLE,
                        help="an appo job run file (same hyperparameters)")  # fmt: skip
    parser.add_argument("--no-appo", action="store_true", help="skip the appo runs")
    parser.add_argument("--profile-updates", type=int, default=0,
                        help="profile N updates of each job's learner (0: none)")  # fmt: skip
    args = parser.parse_args()
    config = yaml.safe_load(args.config.read_text())
    appo = None if args.no_appo else yaml.safe_load(args.appo_config.read_text())
    job = config["job"]
    rows = []
    profiles = {}
    with tempfile.TemporaryDirectory(prefix="rlfleet-bench-") as tmp:
        if args.profile_updates:
            from bench.ppo_update_profile import print_profile, profile

            for kind, path in (("ppo", args.config), ("appo", args.appo_config)):
                profiles[kind] = profile(path, args.profile_updates, Path(tmp) / f"prof-{kind}")
                print_profile(profiles[kind])
        for seed in args.seeds:
            baseline = run_baseline(_baseline_args(job, seed))
            system = run_system(config, seed, Path(tmp))
            rows.append({"seed": seed, "baseline": baseline, "system": system})
            if appo is not None:
                rows[-1]["appo"] = run_system(appo, seed, Path(tmp), kind="appo")
            _print_row(rows[-1])
    summary = _summary(rows)
    print(json.dumps(summary, indent=2))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    result = {
        "benchmark": "ppo_cartpole",
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "config": str(args.config),
        "target_return": TARGET,
        "rows": [{**r, "baseline": {k: v for k, v in r["baseline"].items() if k != "args"}}
                 for r in rows],
        "summary": summary,
        **({"update_profile": profiles} if profiles else {}),
    }  # fmt: skip
    args.out.write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(f"wrote {args.out}")
    return 0


def _print_row(row: dict[str, Any]) -> None:
    b, s = row["baseline"], row["system"]
    print(
        f"seed {row['seed']}: baseline {b['reached_target_at_step']} steps, "
        f"{b.get('reached_target_wall_s') or float('nan'):.1f}s, {b['sps']:.0f} SPS | "
        f"system {s['reached_target_at_step']} steps, {s['reached_target_wall_s'] or 0:.1f}s "
        f"(start-up {s['startup_s']:.1f}s), {s['sps']:.0f} SPS | "
        f"ratio {s['sps'] / b['sps']:.2f}x",
        flush=True,
    )
    a = row.get("appo")
    if a is not None:
        print(
            f"        appo {a['reached_target_at_step']} steps, "
            f"{a['reached_target_wall_s'] or 0:.1f}s (start-up {a['startup_s']:.1f}s), "
            f"{a['sps']:.0f} SPS | ratio {a['sps'] / b['sps']:.2f}x",
            flush=True,
        )


def _summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    import statistics

    ratios = [r["system"]["sps"] / r["baseline"]["sps"] for r in rows]
    appo = [r for r in rows if "appo" in r]
    extra: dict[str, Any] = {}
    if appo:
        appo_ratios = [r["appo"]["sps"] / r["baseline"]["sps"] for r in appo]

        def median_time(side: str) -> float | None:
            times = [r[side]["reached_target_wall_s"] for r in appo]
            done = [t for t in times if t is not None]
            return statistics.median(done) if done else None

        extra = {
            "appo_sps_ratio_median": statistics.median(appo_ratios),
            "appo_sps_ratios": appo_ratios,
            "appo_reached": sum(r["appo"]["reached_target_at_step"] is not None for r in appo),
            "appo_time_to_target_s_median": median_time("appo"),
            "appo_train_time_to_target_s_median": statistics.median(
                [r["appo"]["reached_target_train_s"] or math.inf for r in appo]
            ),
            "system_time_to_target_s_median": median_time("system"),
            "system_train_time_to_target_s_median": statistics.median(
                [r["system"]["reached_target_train_s"] or math.inf for r in appo]
            ),
            "baseline_time_to_target_s_median": median_time("baseline"),
        }
    return {
        **extra,
        "sps_ratio_median": statistics.median(ratios),
        "sps_ratios": ratios,
        "system_reached": sum(r["system"]["reached_target_at_step"] is not None for r in rows),
        "baseline_reached": sum(r["baseline"]["reached_target_at_step"] is not None for r in rows),
        "seeds": [r["seed"] for r in rows],
    }


if __name__ == "__main__":
    sys.exit(main())
