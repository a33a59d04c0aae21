"""The agent examples as users run them: each ``examples/agent_*.yaml`` through ``rlfleet up``,
held-out accuracy after the SFT warm start (the learner's evaluation at update 0) and after RL
(its last evaluation), with the run's length.

Each example is copied with its own run name under runs/bench/agent_examples/ (so a user's
runs/<name> is left alone) and run to its end; the held-out numbers are the learner's
``learner/eval.jsonl`` (greedy episodes of the env's eval split, or the agent program's
held-out questions for agent_openai). An example's model is made by ``init_model`` on first use
(its env's tokenizer), as ``rlfleet up`` does on a clean checkout.

    .venv/bin/python -m bench.lm.agent_examples [--only agent_calculator agent_guess ...]

Writes bench/results/agent_examples.json (``examples``: name -> ``accuracy_after_sft``,
``accuracy_after_rl``, ``updates``, ``minutes``, ``exit_code``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from bench._shared.results import RESULTS_DIR, ROOT, WORK_DIR, machine, write_results

RESULTS = RESULTS_DIR / "agent_examples.json"
BENCH_DIR = WORK_DIR / "agent_examples"
EXAMPLES = (
    "agent_calculator",
    "agent_calculator_no_tool",
    "agent_guess",
    "agent_custom_env",
    "agent_openenv",
    "agent_openai",
)


def run_example(name: str, timeout_s: float) -> dict[str, Any]:
    """``rlfleet up`` on a copy of examples/<name>.yaml; its evaluations."""
    source = ROOT / "examples" / f"{name}.yaml"
    config = yaml.safe_load(source.read_text())
    run_dir = BENCH_DIR / name
    shutil.rmtree(run_dir, ignore_errors=True)
    config["run"] = {**config["run"], "dir": str(run_dir)}
    # Beside the example, so what it names relative to its folder (a .py env, the agent
    # program) resolves as it does for the example itself.
    copy = source.with_name(f".bench-{name}.yaml")
    copy.write_text(yaml.safe_dump(config, sort_keys=False))
    started = time.time()
    try:
        with (BENCH_DIR / f"{name}.log").open("w") as log:
            code = subprocess.call(
                [sys.executable, "-m", "launch", "up", str(copy), "--no-dashboard"],
                cwd=ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
                timeout=timeout_s,
            )
    except subprocess.TimeoutExpired:
        code = None
    finally:
        copy.unlink(missing_ok=True)
    minutes = (time.time() - started) / 60
    evals_path = run_dir / "learner" / "eval.jsonl"
    evals = (
        [json.loads(x) for x in evals_path.read_text().splitlines()] if evals_path.exists() else []
    )
    return {
        "accuracy_after_sft": evals[0]["eval/accuracy"] if evals else None,
        "accuracy_after_rl": evals[-1]["eval/accuracy"] if len(evals) > 1 else None,
        "updates": int(evals[-1]["eval/update"]) if evals else 0,
        "evals": evals,
        "minutes": round(minutes, 2),
        "exit_code": code,
        "config": str(source.relative_to(ROOT)),
    }


def _f(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", choices=EXAMPLES, default=list(EXAMPLES))
    parser.add_argument("--timeout-min", type=float, default=30.0, help="per example")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    BENCH_DIR.mkdir(parents=True, exist_ok=True)
    previous = json.loads(args.out.read_text()).get("examples", {}) if args.out.exists() else {}
    examples = dict(previous)
    for name in args.only:
        print(f"{name}: rlfleet up ...", flush=True)
        examples[name] = run_example(name, args.timeout_min * 60)
    payload = {"machine": machine(), "examples": examples}
    print(f"{'example':<26}{'after SFT':>10}{'after RL':>10}{'updates':>9}{'minutes':>9}")
    for name, r in examples.items():
        sft, rl = (_f(r["accuracy_after_sft"]), _f(r["accuracy_after_rl"]))
        print(f"{name:<26}{sft:>10}{rl:>10}{r['updates']:>9}{r['minutes']:>9.1f}")
    write_results(args.out, payload)


if __name__ == "__main__":
    main()
