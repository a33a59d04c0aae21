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

The agent program's example is then served as users serve what they trained: its ``final/``
exported (``rlfleet export``), a ``serve`` run of it (vLLM behind the gateway, tools on), and
examples/agent_openai.py's own evaluation (``--eval``: the held-out questions, the tool called
through the serving gateway) gives ``served_accuracy``. ``--reuse`` takes the examples' finished
run dirs as they are (to serve again without training again).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from bench._shared.results import RESULTS_DIR, ROOT, WORK_DIR, machine, write_results

RESULTS = RESULTS_DIR / "agent_examples.json"
BENCH_DIR = WORK_DIR / "agent_examples"
SERVED = {"agent_openai": ROOT / "examples" / "agent_openai.py"}  # example -> its agent program
SERVED_QUESTIONS = 64
EXAMPLES = (
    "agent_calculator",
    "agent_calculator_no_tool",
    "agent_guess",
    "agent_custom_env",
    "agent_openenv",
    "agent_openai",
)


def run_example(name: str, timeout_s: float, *, reuse: bool = False) -> dict[str, Any]:
    """``rlfleet up`` on a copy of examples/<name>.yaml (``reuse``: the run dir as it is); its
    evaluations."""
    source = ROOT / "examples" / f"{name}.yaml"
    config = yaml.safe_load(source.read_text())
    run_dir = BENCH_DIR / name
    if reuse:  # the run's length and exit as its launcher recorded them
        state = json.loads((run_dir / "state.json").read_text())
        return {
            **_results(run_dir),
            "minutes": round((state["ended"] - state["started"]) / 60, 2),
            "exit_code": state.get("exit"),
            "config": str(source.relative_to(ROOT)),
        }
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
    return {
        **_results(run_dir),
        "minutes": round(minutes, 2),
        "exit_code": code,
        "config": str(source.relative_to(ROOT)),
    }


def _results(run_dir: Path) -> dict[str, Any]:
    evals_path = run_dir / "learner" / "eval.jsonl"
    evals = (
        [json.loads(x) for x in evals_path.read_text().splitlines()] if evals_path.exists() else []
    )
    return {
        "accuracy_after_sft": evals[0]["eval/accuracy"] if evals else None,
        "accuracy_after_rl": evals[-1]["eval/accuracy"] if len(evals) > 1 else None,
        "updates": int(evals[-1]["eval/update"]) if evals else 0,
        "evals": evals,
    }


def serve_and_ask(name: str, program: Path, timeout_s: float) -> dict[str, Any]:
    """Export the example's trained model, serve it (``kind: serve``, vLLM, one replica) and
    run ``program --eval`` against the gateway: the accuracy the agent program prints."""
    from services.ports import free_port

    run_dir = BENCH_DIR / name
    exported = BENCH_DIR / "exports" / name
    shutil.rmtree(exported, ignore_errors=True)
    exported.parent.mkdir(parents=True, exist_ok=True)
    cli = [sys.executable, "-m", "launch"]
    export = subprocess.run(
        [*cli, "export", str(run_dir), str(exported)], cwd=ROOT, capture_output=True, text=True
    )
    if export.returncode != 0:
        return {"served_error": f"export failed: {export.stderr[-1500:]}"}
    port = free_port()
    serve_name = f"serve-{name}".replace("_", "-")  # a run name: [a-z0-9-]
    config = BENCH_DIR / f"{serve_name}.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "run": {"name": serve_name, "dir": str(BENCH_DIR / serve_name)},
                "job": {
                    "kind": "serve", "model": str(exported), "served_model_name": name,
                    "replicas": 1, "engine": "vllm", "max_model_len": 512, "kv_cache_gib": 1,
                    "host": "127.0.0.1", "port": port,
                },
            }
        )
    )  # fmt: skip
    log_path = BENCH_DIR / f"{serve_name}.log"
    with log_path.open("w") as log:
        up = subprocess.Popen(
            [*cli, "up", str(config), "--no-dashboard"], cwd=ROOT, stdout=log,
            stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + timeout_s
        while not _healthy(url):
            if up.poll() is not None or time.time() > deadline:
                return {"served_error": f"the serve run did not come up: see {log_path}"}
            time.sleep(1)
        started = time.time()
        env = {**os.environ, "OPENAI_API_KEY": "none", "PYTHONPATH": str(ROOT)}
        ask = subprocess.run(
            [sys.executable, str(program), "--eval", str(SERVED_QUESTIONS), "--base-url",
             f"{url}/v1"],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s,
        )  # fmt: skip
        found = re.search(r"accuracy ([0-9.]+)", ask.stdout)
        if ask.returncode != 0 or found is None:
            return {"served_error": f"the agent program failed: {ask.stderr[-1500:]}"}
        return {
            "served_accuracy": float(found.group(1)),
            "served_questions": SERVED_QUESTIONS,
            "served_minutes": round((time.time() - started) / 60, 2),
            "served_model": str(exported.relative_to(ROOT)),
        }
    finally:
        with contextlib.suppress(ProcessLookupError):  # it ended already: its log says why
            os.killpg(up.pid, signal.SIGINT)
        try:
            up.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(up.pid, signal.SIGKILL)
        config.unlink(missing_ok=True)


def _healthy(url: str) -> bool:
    import httpx

    try:
        return bool(httpx.get(f"{url}/health", timeout=2).status_code == 200)
    except httpx.HTTPError:
        return False


def _f(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", choices=EXAMPLES, default=list(EXAMPLES))
    parser.add_argument("--timeout-min", type=float, default=30.0, help="per example")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--reuse", action="store_true", help="the finished run dirs as they are")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    BENCH_DIR.mkdir(parents=True, exist_ok=True)
    previous = json.loads(args.out.read_text()).get("examples", {}) if args.out.exists() else {}
    examples = dict(previous)
    for name in args.only:
        print(f"{name}: rlfleet up ...", flush=True)
        examples[name] = run_example(name, args.timeout_min * 60, reuse=args.reuse)
        if name in SERVED and examples[name]["updates"]:
            print(f"{name}: export, serve, {SERVED[name].name} --eval ...", flush=True)
            examples[name].update(serve_and_ask(name, SERVED[name], args.timeout_min * 60))
    payload = {"machine": machine(), "examples": examples}
    head = f"{'example':<26}{'after SFT':>10}{'after RL':>10}{'served':>8}{'updates':>9}"
    print(f"{head}{'minutes':>9}")
    for name, r in examples.items():
        sft, rl = (_f(r["accuracy_after_sft"]), _f(r["accuracy_after_rl"]))
        served = _f(r.get("served_accuracy"))
        minutes = r.get("minutes", 0.0)
        print(f"{name:<26}{sft:>10}{rl:>10}{served:>8}{r['updates']:>9}{minutes:>9.1f}")
    write_results(args.out, payload)


if __name__ == "__main__":
    main()
