"""The chaos test (tests/e2e/test_chaos.py) over many random seeds: SIGKILLs of NATS, the
learner, an env server and an actor during CartPole PPO runs, each audited for fragments lost
or applied twice.

    .venv/bin/python -m bench.game.chaos_soak            # 20 seeds, what `make soak` runs
    .venv/bin/python -m bench.game.chaos_soak --seeds 3 --first-seed 653694

Writes `bench/results/chaos_soak.json`: `seeds` (runs made), `failed` (runs that did not end
audited: a recovery or the orderly stop did not happen), `lost` and `doubled` (fragments over
all runs; the targets are 0 and 0), and `runs` (each seed's kills and audit, or its error).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench._shared.results import RESULTS_DIR, ROOT, machine, write_results

TEST = "tests/e2e/test_chaos.py"
RUN_TIMEOUT_S = 900  # one seed's run, kills and recoveries included, on a loaded machine


def run_seed(seed: int) -> dict[str, Any]:
    """One chaos run under pytest; its audit, or why there is none."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.jsonl"
        env = {**os.environ, "RLFLEET_CHAOS_SEED": str(seed), "RLFLEET_CHAOS_REPORT": str(report)}
        started = time.monotonic()
        try:
            done = subprocess.run(
                [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", TEST],
                cwd=ROOT, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S,
            )  # fmt: skip
            output, code = done.stdout + done.stderr, done.returncode
        except subprocess.TimeoutExpired as exc:
            output, code = f"timed out after {exc.timeout:g}s", -1
        seconds = round(time.monotonic() - started, 1)
        if code == 0 and report.exists():
            record: dict[str, Any] = json.loads(report.read_text().splitlines()[-1])
            return {**record, "seconds": seconds}
        return {"seed": seed, "seconds": seconds, "error": output.strip().splitlines()[-20:]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=20, help="runs to make (default 20)")
    parser.add_argument("--first-seed", type=int, help="seeds first, first+1, ... (else random)")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "chaos_soak.json")
    args = parser.parse_args()
    first = random.randrange(1_000_000) if args.first_seed is None else args.first_seed
    runs = []
    for seed in range(first, first + args.seeds):
        run = run_seed(seed)
        runs.append(run)
        outcome = (
            f"lost {len(run['lost'])}, doubled {len(run['doubled'])}, applied {run['applied']}"
            if "error" not in run
            else "FAILED: " + " / ".join(run["error"][-2:])
        )
        print(f"seed {seed:>7}  {run['seconds']:>6.1f} s  {outcome}", flush=True)
    audited = [r for r in runs if "error" not in r]
    result = {
        "seeds": len(runs),
        "failed": len(runs) - len(audited),
        "lost": sum(len(r["lost"]) for r in audited),
        "doubled": sum(len(r["doubled"]) for r in audited),
        "runs": runs,
    }
    print(
        f"{result['seeds']} seeds: {result['failed']} failed, "
        f"{result['lost']} lost, {result['doubled']} doubled"
    )
    write_results(args.out, {"machine": machine(), **result})


if __name__ == "__main__":
    main()
