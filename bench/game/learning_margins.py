"""The learning test's margins: tests/e2e/test_game_link_ts.py's exact scenario run N times.

    .venv/bin/python -m bench.game.learning_margins --runs 10
    .venv/bin/python -m bench.game.learning_margins --runs 3 --total-timesteps 200000

Each run is what the test does: `rlfleet up` on its shortened examples/snake_ts.yaml (the
TypeScript Snake, 16 boards over GameLink, `seed` and the game's --seed as the run file sets
them), the game's final mean score (food per episode, last 100 episodes), then `rlfleet play
--env Snake-v0` of the saved policy (20 episodes). Seeded as it is, a run still meets the
learner's weight versions when the machine's timing says, so the scores spread; the test's
MIN_SCORE is set from that spread measured under the machine's usual load.

Writes `bench/results/learning_margins.json` (after every run, so a long measurement that is
cut short keeps what it has): `runs` (per run: `game_score`, `played_score`, `train_s`,
`play_s`, `wall_s`, `loadavg_start`, `loadavg_end`, `loadavg_1m_mean` sampled during the run,
or `error`), `metrics` (per metric: `n`, `mean`, `std` (sample), `min`, `max`,
`mean_minus_3std`), `thresholds` (`suggested_min_score`: the weaker metric's mean - 3 std
rounded down to 0.1; `random_score`; `floor`: 3x random, below which the budget should grow
instead; `suggestion_clears_floor`; `test_min_score`: the test's constant when measured),
`scenario`, `machine`, and `earlier_budgets` (the same for other TOTAL_TIMESTEPS the file held
before, newest last).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from bench._shared.results import RESULTS_DIR, WORK_DIR, machine, write_results
from tests.e2e import test_game_link_ts as scenario
from tests.fixtures.launch import Up

METRICS = ("game_score", "played_score")
FLOOR_X_RANDOM = 3.0  # a threshold below 3x random play says too little: train longer instead


class LoadSampler:
    """The 1-minute load average every few seconds, in a thread, while a run goes on."""

    def __init__(self, every_s: float = 5.0) -> None:
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._every_s = every_s
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            self.samples.append(os.getloadavg()[0])
            if self._stop.wait(self._every_s):
                return

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        return round(statistics.fmean(self.samples), 2)


def run_once(index: int, total_timesteps: int) -> dict[str, Any]:
    """One run of the test's scenario: its two scores, times and the load, or its error."""
    record: dict[str, Any] = {"run": index, "loadavg_start": list(os.getloadavg())}
    load = LoadSampler()
    started = time.monotonic()
    WORK_DIR.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="learning-margins-", dir=WORK_DIR) as tmp:
        config, run_dir, _name = scenario.write_config(Path(tmp), total_timesteps)
        up = Up(config, run_dir, services=scenario.SERVICES, budget_s=scenario.RUN_TIMEOUT_S)
        try:
            code = up.wait()
            record["train_s"] = round(time.monotonic() - started, 1)
            if code != 0:
                raise AssertionError(f"the run failed (exit {code})")
            game_log = (run_dir / "logs" / "game-0.log").read_text()
            record["game_score"] = scenario.final_mean_score(game_log)
        except (AssertionError, OSError) as exc:
            record["error"] = str(exc).splitlines()[:3] + up.diagnostics().splitlines()[-30:]
        finally:
            up.stop()
        if "error" not in record:
            played = time.monotonic()
            try:
                record["played_score"] = scenario.play_in_snake_v0(run_dir, Path(tmp) / "p.json")
                record["play_s"] = round(time.monotonic() - played, 1)
            except (AssertionError, OSError) as exc:
                record["error"] = str(exc).splitlines()[-30:]
    record["wall_s"] = round(time.monotonic() - started, 1)
    record["loadavg_1m_mean"] = load.stop()
    record["loadavg_end"] = list(os.getloadavg())
    return record


def metric_stats(values: list[float]) -> dict[str, Any]:
    """n, mean, sample std, min, max and mean - 3 std (None where too few values)."""
    if not values:
        return {"n": 0}
    mean = statistics.fmean(values)
    std = statistics.stdev(values) if len(values) > 1 else None
    return {
        "n": len(values),
        "mean": round(mean, 3),
        "std": None if std is None else round(std, 3),
        "min": min(values),
        "max": max(values),
        "mean_minus_3std": None if std is None else round(mean - 3 * std, 3),
    }


def thresholds(metrics: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The threshold the rule gives: the weaker metric's mean - 3 std, rounded down to 0.1."""
    margins = {k: m.get("mean_minus_3std") for k, m in metrics.items()}
    known = {k: v for k, v in margins.items() if v is not None}
    floor = round(FLOOR_X_RANDOM * scenario.RANDOM_SCORE, 3)
    out: dict[str, Any] = {
        "rule": "min over metrics of mean - 3 std (sample), rounded down to 0.1; "
        f"at least {FLOOR_X_RANDOM:g}x random, else raise TOTAL_TIMESTEPS",
        "random_score": scenario.RANDOM_SCORE,
        "floor": floor,
        "test_min_score": scenario.MIN_SCORE,
    }
    if known:
        weaker = min(known, key=lambda k: known[k])
        suggested = math.floor(known[weaker] * 10 + 1e-9) / 10
        out |= {
            "weaker_metric": weaker,
            "suggested_min_score": suggested,
            "suggestion_clears_floor": suggested >= floor,
        }
    return out


def earlier_budgets(out: Path, total_timesteps: int) -> list[dict[str, Any]]:
    """What `out` holds of other budgets (a measurement that led to raising TOTAL_TIMESTEPS),
    kept beside the new one; a file of the same budget is replaced."""
    if not out.exists():
        return []
    old = json.loads(out.read_text())
    kept = [e for e in old.get("earlier_budgets", []) if e["total_timesteps"] != total_timesteps]
    if old["scenario"]["total_timesteps"] != total_timesteps:
        keys = ("metrics", "thresholds", "load_1m_mean_over_runs", "failed", "runs", "machine")
        kept.append(
            {"total_timesteps": old["scenario"]["total_timesteps"]}
            | {k: old[k] for k in keys if k in old}
        )
    return kept


def table(runs: list[dict[str, Any]], metrics: dict[str, dict[str, Any]]) -> str:
    def num(value: Any, spec: str = ".2f") -> str:
        return "-" if value is None else format(value, spec)

    lines = [
        f"{'run':>3} {'game':>6} {'played':>7} {'train s':>8} {'play s':>7} "
        f"{'load 1m (mean)':>15}  error"
    ]
    for r in runs:
        lines.append(
            f"{r['run']:>3} {num(r.get('game_score')):>6} {num(r.get('played_score')):>7} "
            f"{num(r.get('train_s'), '.0f'):>8} {num(r.get('play_s'), '.0f'):>7} "
            f"{num(r.get('loadavg_1m_mean')):>15}  {(r.get('error') or [''])[0][:40]}"
        )
    lines.append("")
    lines.append(f"{'metric':<13} {'n':>2} {'mean':>6} {'std':>6} {'min':>6} {'mean-3std':>9}")
    for key, m in metrics.items():
        lines.append(
            f"{key:<13} {m['n']:>2} {num(m.get('mean')):>6} {num(m.get('std')):>6} "
            f"{num(m.get('min')):>6} {num(m.get('mean_minus_3std')):>9}"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=10, help="runs to make (default 10)")
    parser.add_argument(
        "--total-timesteps",
        type=int,
        default=scenario.TOTAL_TIMESTEPS,
        help=f"env steps per run (default: the test's, {scenario.TOTAL_TIMESTEPS})",
    )
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "learning_margins.json")
    args = parser.parse_args()

    scenario.build_sdk()
    facts = machine()
    earlier = earlier_budgets(args.out, args.total_timesteps)
    runs: list[dict[str, Any]] = []
    metrics: dict[str, dict[str, Any]] = {}
    for index in range(args.runs):
        runs.append(run_once(index, args.total_timesteps))
        r = runs[-1]
        print(
            f"run {index}: game {r.get('game_score')} played {r.get('played_score')} "
            f"in {r['wall_s']:.0f}s, load {r['loadavg_1m_mean']}"
            + (f" ERROR {r['error'][:1]}" if "error" in r else ""),
            flush=True,
        )
        metrics = {k: metric_stats([r[k] for r in runs if k in r]) for k in METRICS}
        loads = [r["loadavg_1m_mean"] for r in runs]
        write_results(
            args.out,
            {
                "runs": runs,
                "metrics": metrics,
                "thresholds": thresholds(metrics),
                "load_1m_mean_over_runs": round(statistics.fmean(loads), 2),
                "failed": sum("error" in r for r in runs),
                "scenario": {
                    "test": "tests/e2e/test_game_link_ts.py",
                    "run_file": str(scenario.EXAMPLE),
                    "total_timesteps": args.total_timesteps,
                    "services": list(scenario.SERVICES),
                    "play": "rlfleet play RUN --env Snake-v0 --episodes 20 (seed 0)",
                },
                "machine": dict(facts),
                "earlier_budgets": earlier,
            },
        )
    print(table(runs, metrics))
    print(thresholds(metrics))


if __name__ == "__main__":
    main()
