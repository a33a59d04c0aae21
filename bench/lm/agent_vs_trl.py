"""Multi-turn RL with a tool through the fleet against TRL's GRPOTrainer with an environment:
held-out accuracy against wall time from process start, on the same model, task and GRPO
hyperparameters.

The task is examples/agent_calculator.yaml's: Calculator-v0 (3-digit arithmetic with a product,
answered by calling a `calculator` tool in the chat template's format). Both sides start from one
shared post-SFT model: the job's ``init-model`` made for the env (its episodes train the
tokenizer), warm-started on the env's expert demonstrations exactly as the learner's SFT phase
does it (``EnvEpisodes.demonstrations`` on an env server, ``learner.lm.sft.sft_phase`` on a
DeepSpeed engine), saved once under ``runs/bench/agent_vs_trl/``. Then, one after the other, each
for ``--minutes`` of wall time from its process start:

- rlfleet: ``rlfleet up`` on the run file with that model, ``sft_steps: 0`` and an unbounded
  ``total_updates``: NATS, the env server, the vLLM sampler, the rollout driver (episodes played
  turn by turn, token in, token out) and the DeepSpeed learner; stopped with SIGINT at the
  budget. Accuracy: the learner's ``eval/accuracy`` records in the run's metrics.jsonl.
- TRL: bench/lm/agent_trl_reference.py in ``bench/.venv-trl`` (TRL from
  bench/lm/requirements-trl.txt, layered over the project's venv): ``GRPOTrainer`` with
  ``environment_factory`` (the calculator as the environment's tool, the same schema and result
  format as Calculator-v0's), the env's openings of the same train seeds as its dataset, the
  env's answer check as the reward, TRL's own generation and tool loop, the same group size,
  episodes per update, learning rate, clip and KL (the ``grpo`` preset).

Both evaluate with the learner's own evaluator (``EnvEpisodes.evaluate``: greedy episodes of the
env's eval split on an env server, the same seeds) at update 0 and every ``--eval-every``
updates, the evaluation's time included in their clocks. ``accuracy_ratio_at_5_10_15_min`` is
rlfleet / TRL at a third, two thirds and all of the budget; the issue's target is >= 1.0 at each.

    python -m bench.lm.agent_vs_trl                 # 2 x 15 minutes, plus the SFT model once
    python -m bench.lm.agent_vs_trl --minutes 2     # smoke check

Prints the accuracy table and writes bench/results/agent_vs_trl.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench._shared.job_overrides import apply_overrides, parse_overrides
from bench._shared.lm import service_process, stop_process
from bench._shared.results import RESULTS_DIR, ROOT, WORK_DIR, machine, write_results
from bench._shared.venvs import ensure_venv
from bench.lm.grpo_vs_trl import (
    CHILD_ENV,
    SIDES,
    TRL_REQUIREMENTS,
    TRL_VENV,
    _number,
    _wait_until,
    load_job,
    print_table,
    run_rlfleet,
    summarize,
)

RESULTS = RESULTS_DIR / "agent_vs_trl.json"
BENCH_DIR = WORK_DIR / "agent_vs_trl"
TRL_DIAGNOSTICS = {
    "reward": "reward", "entropy": "entropy", "kl": "kl",
    "clip_fraction": "clip_ratio/region_mean", "zero_std_groups": "frac_reward_zero_std",
    "completion_len": "completions/mean_length", "update_s": "step_time",
}  # fmt: skip


def env_spec(settings: Any) -> dict[str, Any]:
    """What the reference side needs of the job's env (as the learner's LearnerTextEnv)."""
    env = settings.env
    return {"env_id": env.env_id, "kwargs": env.kwargs, "max_turns": env.max_turns,
            "max_total_tokens": env.max_total_tokens}  # fmt: skip


def post_sft_model(settings: Any) -> Path:
    """The shared starting point: the job's init-model for its env, warm-started on the env's
    expert demonstrations as the learner's SFT phase does (made once)."""
    name = f"{settings.init_model}-seed{settings.seed}-sft{settings.sft_steps}"
    out = BENCH_DIR / "models" / name
    if (out / "model.safetensors").is_file():
        return out
    from learner.engine import build_engine
    from learner.lm.env_episodes import EnvEpisodes
    from learner.lm.jobs import create_model
    from learner.lm.model import load_causal_lm, load_tokenizer
    from learner.lm.settings import LearnerTextEnv
    from learner.lm.sft import sft_phase
    from learner.settings import DeepSpeedSettings, OptimizerSettings

    env = env_spec(settings)
    base = BENCH_DIR / "models" / f"{settings.init_model}-seed{settings.seed}"
    if not (base / "config.json").is_file():
        create_model(base, settings.init_model, dataset=settings.dataset, seed=settings.seed,
                     env={"env_id": env["env_id"], "kwargs": env["kwargs"]})  # fmt: skip
    print(f"SFT warm start: {settings.sft_steps} steps -> {out}", flush=True)
    tokenizer = load_tokenizer(base)
    server, address = service_process("env_server", BENCH_DIR / "sft", "env-sft")
    try:
        episodes = EnvEpisodes(LearnerTextEnv(env_server=address, **env), address, tokenizer)
        count = settings.sft_steps * settings.sft_batch_size
        demos = asyncio.run(episodes.demonstrations(count, settings.seed))
    finally:
        stop_process(server)
    model = load_causal_lm(base)
    engine = build_engine(model, OptimizerSettings(lr=settings.sft_learning_rate, eps=1e-8),
                          DeepSpeedSettings())  # fmt: skip
    sft_phase(engine, tokenizer, iter(demos),
              steps=settings.sft_steps, batch_size=settings.sft_batch_size,
              learning_rate=settings.sft_learning_rate)  # fmt: skip
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    shutil.copytree(base, partial)
    engine.module.save_pretrained(partial)
    partial.rename(out)
    return out


def run_trl(settings: Any, model: Path, budget_s: float, eval_every: int) -> dict:
    """bench/lm/agent_trl_reference.py in the TRL venv for ``budget_s`` from its start."""
    python = ensure_venv(TRL_VENV, TRL_REQUIREMENTS, layered_over=ROOT / ".venv")
    out = BENCH_DIR / "trl"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    s = settings
    reference_job = {
        "env": env_spec(s), "group_size": s.group_size, "groups_per_update": s.groups_per_update,
        "max_tokens": s.max_tokens, "temperature": s.temperature,
        "learning_rate": s.learning_rate, "epochs": s.epochs, "seed": s.seed,
        "eval_count": s.eval_count,
        "max_updates": int(budget_s / 0.2) + 10,  # a bound: the budget stops it first
    }  # fmt: skip
    (out / "job.json").write_text(json.dumps(reference_job, indent=2))
    env = {**CHILD_ENV, "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false",
           "OMP_NUM_THREADS": str(os.cpu_count() or 1),
           "TRL_EXPERIMENTAL_SILENCE": "1"}  # fmt: skip
    started = time.time()
    cmd = [str(python), "-m", "bench.lm.agent_trl_reference", "--job", str(out / "job.json"),
           "--model", str(model), "--out", str(out), "--budget-s", str(budget_s),
           "--started", str(started), "--eval-every", str(eval_every)]  # fmt: skip
    with (out / "console.log").open("w") as console:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=console, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip
        _wait_until(proc, started + budget_s + 60)
        stop_process(proc, signal.SIGTERM, group=True, wait_s=120)
    evals = [json.loads(x) for x in (out / "eval.jsonl").read_text().splitlines()]
    updates = [
        {"time_s": r["time_s"], "update": r["update"],
         **{name: _number(r.get(key)) for name, key in TRL_DIAGNOSTICS.items()}}
        for r in map(json.loads, (out / "log.jsonl").read_text().splitlines())
        if "loss" in r
    ]  # fmt: skip
    return {"evals": evals, "updates": updates, "exit_code": proc.returncode}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=ROOT / "examples" / "agent_calculator.yaml")
    parser.add_argument("--minutes", type=float, default=15.0, help="wall budget of each side")
    parser.add_argument("--eval-every", type=int, default=10, help="updates between evaluations")
    parser.add_argument("--only", choices=SIDES, nargs="+", default=list(SIDES))
    parser.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE", dest="overrides",
                        help="job keys for the rlfleet side, YAML values, dotted for nested "
                        "ones: engine=hf")  # fmt: skip
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    job, settings = load_job(args.config)
    if settings.env is None:
        sys.exit(f"{args.config}: not an env job (no env:); bench.lm.grpo_vs_trl is single-turn")
    overrides = parse_overrides(args.overrides)
    apply_overrides(job, overrides)
    budget_s = args.minutes * 60
    checkpoints = [budget_s / 3, 2 * budget_s / 3, budget_s]
    payload: dict[str, Any] = {"machine": machine({"config": str(args.config)})}
    payload["rlfleet_overrides"] = overrides
    model = post_sft_model(settings)
    sides: dict[str, dict] = {}
    for name in args.only:
        print(f"{name}: {args.minutes:g} minutes from process start ...", flush=True)
        if name == "rlfleet":
            run_dir = BENCH_DIR / "rlfleet"
            sides[name] = run_rlfleet(
                job, model, budget_s, args.eval_every, run_dir=run_dir, run_name="agent-vs-trl"
            )
        else:
            sides[name] = run_trl(settings, model, budget_s, args.eval_every)
        sides[name]["summary"] = summarize(sides[name], checkpoints, budget_s)
    payload.update(model=str(model), budget_s=budget_s, checkpoints_s=checkpoints, sides=sides)
    if len(sides) == 2:
        ours, theirs = (sides[n]["summary"]["accuracy_at"] for n in SIDES)
        ratios = [a / b if a is not None and b else None for a, b in zip(ours, theirs, strict=True)]
        payload["accuracy_ratio_at_5_10_15_min"] = ratios
        payload["target_met"] = all(r is not None and r >= 1.0 for r in ratios)
    print_table(payload)
    write_results(args.out, payload)


if __name__ == "__main__":
    main()
