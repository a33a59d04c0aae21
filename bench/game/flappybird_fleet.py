"""Flappy Bird at the seed's scale: 256 envs over 4 env servers, two of them added while it trains.

For each seed, `rlfleet up` trains PPO on FlappyBird-v0 (the env's 12 features, as
examples/flappybird_ppo.yaml) with `--actors` actors of `--envs` envs each, split over the env
servers env-0 and env-1. Once the learner has taken `--join-at` of the step budget, a second
replica of each (`env-0#2`, `env-1#2`) joins the run as a deployment adds one; the actors find
them in the run's membership and spread their envs over all four, with nothing restarted. When
the run ends, its final policy plays `--episodes` greedy episodes (episode i reset with seed i,
at most `--max-steps` steps each, as `rlfleet play --deterministic`); an episode passes when its
score (pipes passed, the env's info["score"]) reaches `--pipes`.

    .venv/bin/python -m bench.game.flappybird_fleet                 # seeds 1 2 3
    .venv/bin/python -m bench.game.flappybird_fleet --seeds 2       # one seed; the others kept

Writes bench/results/flappybird.json: per seed the pass fraction, scores, wall minutes from
launch to the end of training, env steps/s before and after the replicas joined and the env
servers each actor ended on; `pass20_fraction_min_over_seeds` over every seed recorded (a seed
run alone replaces its own entry), with the targets (a fraction of at least 0.9 for each of 3
seeds, each within 60 minutes).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from bench._shared.fleet import launched, learner_steps, steps_per_s, wait_for
from bench._shared.job_overrides import apply_overrides, parse_overrides
from bench._shared.results import RESULTS_DIR, ROOT, WORK_DIR, machine, write_results
from env_server.play import play

RESULTS = RESULTS_DIR / "flappybird.json"
TARGET_FRACTION = 0.9
TARGET_SEEDS = 3
TARGET_MINUTES = 60.0
INSTANCES = ("env-0", "env-1")


def job(a: argparse.Namespace, seed: int) -> dict[str, Any]:
    """The PPO job: examples/flappybird_ppo.yaml's algorithm at 256 envs."""
    settings: dict[str, Any] = {
        "kind": "ppo",
        "env_id": "FlappyBird-v0",
        "env_kwargs": {"use_lidar": False},
        "env_servers": len(INSTANCES),
        "num_actors": a.actors,
        "num_envs": a.envs,
        "rollout_length": a.rollout,
        "fragments_per_update": a.actors,
        "total_timesteps": a.steps,
        "update_epochs": 10,
        "minibatch_size": 1024,
        "learning_rate": 0.001,
        "anneal_lr": True,
        "gamma": 0.99,
        "gae_lambda": 0.95,
        "ent_coef": 0.005,
        "clip_coef": 0.2,
        "clip_vloss": False,
        "max_policy_lag": 1,
        "seed": seed,
        "device": "cpu",
    }
    apply_overrides(settings, parse_overrides(a.set))
    return settings


def ended_on(run_dir: Path) -> dict[str, list[str]]:
    """Per actor, the env servers of its last layout (its log's "envs a-b on ..." lines)."""
    layouts: dict[str, list[str]] = {}
    for log in sorted((run_dir / "logs").glob("actor-*.log")):
        lines = re.findall(r"envs \d+-\d+ on (.+)$", log.read_text(errors="replace"), re.M)
        if lines:
            layouts[log.stem] = [part.strip() for part in lines[-1].split(", ")]
    return layouts


def train_and_play(a: argparse.Namespace, seed: int) -> dict[str, Any]:
    work = WORK_DIR / f"flappybird-{seed}-{os.getpid()}"
    work.mkdir(parents=True, exist_ok=True)
    run_dir = work / "run"
    config = {"run": {"name": f"flappy-{seed}-{os.getpid()}", "dir": str(run_dir)}}
    config["job"] = job(a, seed)
    path = work / "run.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    started = time.time()
    with launched(path, work) as run:
        joined_at_step = a.join_at * a.steps
        wait_for(
            "the step to add replicas at",
            lambda: any(s >= joined_at_step for _, s in learner_steps(run_dir)),
            a.timeout_min * 60,
            poll_s=2.0,
        )
        joined = time.time()
        for instance in INSTANCES:
            run.join_env_server(instance, "2")
        print(f"  seed {seed}: replicas joined at {(joined - started) / 60:.1f} min", flush=True)
        status = run.wait(max(1.0, a.timeout_min * 60 - (time.time() - started)))
    points = learner_steps(run_dir)
    if status != 0 or not points:
        raise SystemExit(f"seed {seed}: the run ended with {status}; see {work / 'up.log'}")
    trained_min = (points[-1][0] - started) / 60
    result = play(
        run_dir,
        episodes=a.episodes,
        deterministic=True,
        max_steps=a.max_steps,
        runs_root=run_dir.parent,
    )
    scores = [int(e.info.get("score", 0)) for e in result.episodes]
    passed = sum(score >= a.pipes for score in scores)
    return {
        "seed": seed,
        "pass_fraction": passed / len(scores),
        "scores": scores,
        "mean_score": sum(scores) / len(scores),
        "min_score": min(scores),
        "capped_episodes": sum(e.capped for e in result.episodes),
        "env_steps": points[-1][1],
        "train_minutes": round(trained_min, 2),
        "steps_per_s_before_join": steps_per_s(points, started, joined),
        "steps_per_s_after_join": steps_per_s(points, joined + a.settle_s, points[-1][0]),
        "ended_on": ended_on(run_dir),
        "config": config["job"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--actors", type=int, default=2)
    parser.add_argument("--envs", type=int, default=128, help="envs per actor")
    parser.add_argument("--rollout", type=int, default=16, help="steps per env per fragment")
    parser.add_argument("--steps", type=int, default=8_000_000, help="env steps per seed")
    parser.add_argument("--join-at", type=float, default=0.1, help="fraction of the steps")
    parser.add_argument("--settle-s", type=float, default=15.0)
    parser.add_argument("--episodes", type=int, default=50)
    parser.add_argument("--pipes", type=int, default=20, help="an episode passes at this score")
    parser.add_argument("--max-steps", type=int, default=5000, help="per evaluation episode")
    parser.add_argument("--timeout-min", type=float, default=TARGET_MINUTES)
    parser.add_argument("--set", action="append", default=[], help="KEY=VALUE job override")
    a = parser.parse_args()

    seeds: dict[str, Any] = {}
    if RESULTS.exists():  # a seed run alone keeps the others' last results
        seeds = json.loads(RESULTS.read_text()).get("seeds", {})
    for seed in a.seeds:
        print(f"seed {seed}: {a.actors * a.envs} envs, {a.steps:,} env steps", flush=True)
        seeds[str(seed)] = train_and_play(a, seed)
        write_results(RESULTS, summarise(a, seeds))
    out = summarise(a, seeds)
    write_results(RESULTS, out)
    print()
    print(f"{'seed':>5}{'pass':>7}{'mean':>8}{'min':>6}{'minutes':>9}{'steps/s':>9}{'after':>9}")
    for seed, r in sorted(seeds.items()):
        before, after = r["steps_per_s_before_join"] or 0, r["steps_per_s_after_join"] or 0
        print(
            f"{seed:>5}{r['pass_fraction']:>7.2f}{r['mean_score']:>8.1f}{r['min_score']:>6}"
            f"{r['train_minutes']:>9.1f}{before:>9,.0f}{after:>9,.0f}"
        )
    print(
        f"pass{a.pipes}_fraction_min_over_seeds {out[f'pass{a.pipes}_fraction_min_over_seeds']:.2f}"
        f" (target >= {TARGET_FRACTION} for {TARGET_SEEDS} seeds, each within "
        f"{TARGET_MINUTES:g} min: {'met' if out['target_met'] else 'not met'})"
    )
    print(f"wrote {RESULTS.relative_to(ROOT)}")


def summarise(a: argparse.Namespace, seeds: dict[str, Any]) -> dict[str, Any]:
    fractions = [r["pass_fraction"] for r in seeds.values()]
    minutes = [r["train_minutes"] for r in seeds.values()]
    worst = min(fractions)
    return {
        "benchmark": "flappybird_fleet",
        f"pass{a.pipes}_fraction_min_over_seeds": worst,
        "seeds_recorded": len(seeds),
        "train_minutes_max": max(minutes),
        "target_met": len(seeds) >= TARGET_SEEDS
        and worst >= TARGET_FRACTION
        and max(minutes) <= TARGET_MINUTES,
        "targets": {
            "pass_fraction": TARGET_FRACTION,
            "seeds": TARGET_SEEDS,
            "minutes_per_seed": TARGET_MINUTES,
        },
        "setup": {
            "envs": a.actors * a.envs,
            "env_servers_at_start": len(INSTANCES),
            "env_servers_after_join": 2 * len(INSTANCES),
            "join_at_fraction": a.join_at,
            "episodes": a.episodes,
            "pipes": a.pipes,
            "max_steps": a.max_steps,
        },
        "seeds": seeds,
        "machine": machine(),
        "command": "python -m bench.game.flappybird_fleet " + " ".join(sys.argv[1:]),
        "time": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


if __name__ == "__main__":
    main()
