"""A finished game run's learning curve and evaluation, as the seed's results record them.

    .venv/bin/python -m bench.game.game_results runs/flappybird-ppo --name flappybird_example
    .venv/bin/python -m bench.game.game_results runs/breakout-ppo --name breakout --episodes 10

Reads the run dir the launcher wrote (`rlfleet up`): the learner's `metrics.jsonl` gives the
curve, return (mean of the last training episodes the learner saw, `charts/episodic_return`)
against env steps and against wall time since launch (the launcher writes the run's
`config.yaml` copy at launch, so its mtime is t = 0). Then it plays the saved policy like
`rlfleet play RUN --episodes N --deterministic` (episode i reset with seed i), with `--sampled`
also with sampled actions, and writes `bench/results/<name>.json`: `curve`, `eval` (play's
summary: mean/std/min/max of return, length and the env's `score` where it reports one),
`eval_sampled`, `mean_score` (deterministic), `budget` (env steps, updates,
launch to the last update in minutes) and the run's config.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import yaml

from bench._shared.results import RESULTS_DIR, machine, write_results
from env_server.play import play


def learning_curve(run_dir: Path) -> list[dict[str, float]]:
    """(env step, seconds since launch, return) at every learner update that reported one."""
    launched = (run_dir / "config.yaml").stat().st_mtime
    points = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        event = json.loads(line)
        values = event.get("values", {})
        if event.get("service") != "learner" or "charts/episodic_return" not in values:
            continue
        points.append(
            {
                "step": values["charts/global_step"],
                "wall_s": round(event["time"] - launched, 2),
                "episodic_return": values["charts/episodic_return"],
            }
        )
    return points


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--name", required=True, help="bench/results/<name>.json")
    parser.add_argument("--episodes", type=int, default=50)
    parser.add_argument("--max-steps", type=int, default=10_000, help="per evaluation episode")
    parser.add_argument(
        "--sampled",
        action="store_true",
        help="also evaluate with sampled actions (`eval_sampled`); Atari policies are usually "
        "judged so, since a deterministic one can stall (Breakout: never pressing FIRE again)",
    )
    args = parser.parse_args()

    curve = learning_curve(args.run_dir)
    if not curve:
        raise SystemExit(f"{args.run_dir}: no learner metrics with charts/episodic_return")
    config = yaml.safe_load((args.run_dir / "config.yaml").read_text())

    def evaluate(deterministic: bool) -> dict[str, Any]:
        return play(
            args.run_dir,
            episodes=args.episodes,
            deterministic=deterministic,
            max_steps=args.max_steps,
            runs_root=args.run_dir.parent,
        ).summary()

    evaluation = evaluate(deterministic=True)
    sampled = evaluate(deterministic=False) if args.sampled else None
    result: dict[str, Any] = {
        "benchmark": "game_results",
        "name": args.name,
        "env_id": evaluation["env_id"],
        "mean_score": evaluation.get("mean_score"),
        "eval": {**evaluation, "max_steps": args.max_steps, "seeds": [0, args.episodes - 1]},
        **({"eval_sampled": sampled} if sampled else {}),
        "budget": {
            "env_steps": curve[-1]["step"],
            "updates": len(curve),
            "launch_to_last_update_min": round(curve[-1]["wall_s"] / 60, 2),
        },
        "curve": curve,
        "config": config,
        "machine": machine(),
    }
    every = max(1, len(curve) // 10)
    print(f"{'step':>10} {'minutes':>8} {'return':>8}")
    for point in [*curve[::every], curve[-1]]:
        minutes, ret = point["wall_s"] / 60, point["episodic_return"]
        print(f"{point['step']:>10.0f} {minutes:>8.1f} {ret:>8.2f}")
    for mode, summary in (("deterministic", evaluation), ("sampled", sampled)):
        if summary is None:
            continue
        score = summary.get("mean_score")
        shown = f"score {score:.2f} ± {summary['std_score']:.2f}" if score is not None else ""
        print(
            f"eval ({args.episodes} episodes, {mode}): return "
            f"{summary['mean_return']:.2f} ± {summary['std_return']:.2f} {shown}"
        )
    write_results(RESULTS_DIR / f"{args.name}.json", result)


if __name__ == "__main__":
    main()
