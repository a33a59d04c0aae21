"""GRPO through the fleet against TRL's GRPOTrainer: held-out accuracy against wall time from
process start, and against updates, on the same model, data, rewards and hyperparameters.

Both sides start from one shared post-SFT model: the example's model (``init-model``, the
job's size and seed) warm-started by the learner's own SFT phase (``learner.lm.sft``, the job's
``sft_steps``, batch and learning rate, on a DeepSpeed engine as the learner runs it), saved
once as a Hugging Face folder under ``runs/bench/grpo_vs_trl/``. Then, one after the other,
each for ``--minutes`` of wall time from its process start:

- rlfleet: ``rlfleet up`` on the run file (default examples/grpo_arith.yaml) with that model,
  ``sft_steps: 0`` and an unbounded ``total_updates``: NATS, the vLLM sampler, the reward
  service, the rollout driver and the DeepSpeed learner as separate processes; stopped with
  SIGINT at the budget. Accuracy: the learner's ``eval/accuracy`` records in the run's
  metrics.jsonl.
- TRL: bench/lm/grpo_trl_reference.py in ``bench/.venv-trl`` (TRL 1.16, from
  bench/lm/requirements-trl.txt, layered over the project's venv: the same torch and
  transformers), TRL's own generation (transformers ``generate``, no vLLM), the same prompts,
  reward functions and weights, group size, completions per update (one optimizer step each),
  learning rate, clip, KL, advantage normalisation and loss aggregation (the ``grpo`` preset).

Both evaluate the same held-out prompts with the learner's greedy evaluator at update 0 and
every ``--eval-every`` updates, the evaluation's time included in their clocks. The accuracy
at a checkpoint is that of the last evaluation finished by then. ``accuracy_ratio_at_5_10_15_min``
is rlfleet / TRL at a third, two thirds and all of the budget (5, 10 and 15 minutes by default);
the issue's target is >= 1.0 at each.

    python -m bench.lm.grpo_vs_trl                # 2 x 15 minutes, plus the SFT model once
    python -m bench.lm.grpo_vs_trl --minutes 2    # smoke check (ratios at 40/80/120 s)
    python -m bench.lm.grpo_vs_trl --only rlfleet --set algo.old_logp=recompute --out X.json

Prints the accuracy table and writes bench/results/grpo_vs_trl.json (curves of both sides:
accuracy vs wall time and vs update, updates done, launch to first update).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import yaml

from bench._shared.job_overrides import apply_overrides, parse_overrides
from bench._shared.lm import stop_process
from bench._shared.results import RESULTS_DIR, ROOT, WORK_DIR, machine, write_results
from bench._shared.venvs import ensure_venv

RESULTS = RESULTS_DIR / "grpo_vs_trl.json"
TRL_REQUIREMENTS = Path(__file__).with_name("requirements-trl.txt")
TRL_VENV = ROOT / "bench" / ".venv-trl"
BENCH_DIR = WORK_DIR / "grpo_vs_trl"
SIDES = ("rlfleet", "trl")
# Per-update diagnostics kept beside the curves, under one name for both sides: what to look at
# when one side's accuracy stops rising (entropy, KL to the start, clipping, all-equal groups).
RLFLEET_DIAGNOSTICS = {
    "reward": "reward/total", "train_accuracy": "reward/accuracy", "entropy": "charts/entropy",
    "kl": "losses/kl", "clip_fraction": "losses/clipfrac", "zero_std_groups": "adv/zero_std_frac",
    "policy_lag": "charts/policy_lag", "mismatch_kl": "rollout/mismatch_kl",
    "completion_len": "rollout/completion_len", "update_s": "charts/update_s",
}  # fmt: skip
TRL_DIAGNOSTICS = {
    "reward": "reward", "train_accuracy": "rewards/accuracy/mean", "entropy": "entropy",
    "kl": "kl", "clip_fraction": "clip_ratio/region_mean",
    "zero_std_groups": "frac_reward_zero_std", "completion_len": "completions/mean_length",
    "update_s": "step_time",
}  # fmt: skip
# The children's environment, taken before the SFT's DeepSpeed engine sets this process's
# torch.distributed variables (MASTER_PORT etc.), which a child would try to bind again.
CHILD_ENV = {k: v for k, v in os.environ.items() if not k.startswith("RLFLEET_")}


def load_job(config: Path) -> tuple[dict[str, Any], Any]:
    """The run file's job as written and as the job kind's validated settings."""
    from services.registry import get_job

    job = yaml.safe_load(config.read_text())["job"]
    spec = get_job(job["kind"])
    return job, spec.settings.model_validate({k: v for k, v in job.items() if k != "kind"})


def post_sft_model(settings: Any) -> Path:
    """The shared starting point: the job's init-model, warm-started by the learner's SFT phase
    (made once; the folder's name holds what it depends on)."""
    name = f"{settings.init_model}-seed{settings.seed}-sft{settings.sft_steps}"
    out = BENCH_DIR / "models" / name
    if (out / "model.safetensors").is_file():
        return out
    from common.datasets import iter_tasks
    from learner.lm.jobs import create_model
    from learner.lm.model import load_tokenizer
    from learner.lm.sft import expert_samples

    base = BENCH_DIR / "models" / f"{settings.init_model}-seed{settings.seed}"
    if not (base / "config.json").is_file():
        create_model(base, settings.init_model, dataset=settings.dataset, seed=settings.seed)
    demos = expert_samples(iter_tasks(settings.dataset, split="train"), load_tokenizer(base))
    return learner_sft(settings, base, demos, out)


def learner_sft(settings: Any, base: Path, demos: Iterator[Any], out: Path) -> Path:
    """The job's SFT warm start of the model at ``base`` on ``demos``, run as the job's learner
    runs it (its DeepSpeed engine settings, gradient clipping and packing), saved at ``out``
    beside ``base``'s tokenizer and template."""
    from learner.engine import build_engine
    from learner.lm.jobs import learner_settings
    from learner.lm.model import context_length, load_causal_lm, load_tokenizer
    from learner.lm.sft import sft_phase
    from learner.lm.workload import engine_settings
    from learner.settings import OptimizerSettings

    print(f"SFT warm start: {settings.sft_steps} steps -> {out}", flush=True)
    learner = learner_settings(settings)
    model = load_causal_lm(base)
    engine = build_engine(model, OptimizerSettings(lr=learner.learning_rate, eps=1e-8),
                          engine_settings(learner))  # fmt: skip
    sft_phase(engine, load_tokenizer(base), demos,
              steps=settings.sft_steps, batch_size=settings.sft_batch_size,
              learning_rate=settings.sft_learning_rate,
              pack_tokens=context_length(model) if learner.packing else None)  # fmt: skip
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    shutil.copytree(base, partial)
    engine.module.save_pretrained(partial)
    partial.rename(out)
    return out


# --------------------------------------------------------------------------- the two sides


def run_rlfleet(
    job: dict[str, Any],
    model: Path,
    budget_s: float,
    eval_every: int,
    *,
    run_dir: Path = BENCH_DIR / "rlfleet",
    run_name: str = "grpo-vs-trl",
) -> dict:
    """``rlfleet up`` for ``budget_s`` from launch; its eval and update records."""
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    job = {**job, "model_path": str(model), "init_model": None, "sft_steps": 0,
           "total_updates": 1_000_000, "eval_every": eval_every}  # fmt: skip
    config = {"run": {"name": run_name, "dir": str(run_dir)}, "job": job}
    (run_dir / "run.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    # As a user's shell: the launcher gives each service its threads.
    env = {k: v for k, v in CHILD_ENV.items() if k != "OMP_NUM_THREADS"}
    cmd = [sys.executable, "-m", "launch.cli", "up", str(run_dir / "run.yaml"), "--no-dashboard"]
    started = time.time()
    with (run_dir / "console.log").open("w") as console:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=console, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip
        _wait_until(proc, started + budget_s)
        stop_process(proc, signal.SIGINT, group=True, wait_s=120)
    evals, updates = [], []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record.get("service") != "learner" or record.get("kind") != "metrics":
            continue
        values, at = record["values"], record["time"] - started
        if "eval/accuracy" in values:
            update = int(values["eval/update"])
            evals.append({"time_s": at, "update": update, "accuracy": values["eval/accuracy"]})
        if "losses/loss" in values:
            row = {name: values.get(key) for name, key in RLFLEET_DIAGNOSTICS.items()}
            updates.append({"time_s": at, "update": record["step"], **row})
    return {"evals": evals, "updates": updates, "exit_code": proc.returncode}


def run_trl(job_settings: Any, job: dict[str, Any], model: Path, budget_s: float,
            eval_every: int) -> dict:  # fmt: skip
    """bench/lm/grpo_trl_reference.py in the TRL venv for ``budget_s`` from its start."""
    s = job_settings
    # The learner's own evaluation (prompts, split, reward), as the job expands it.
    from learner.lm.settings import EvalSettings
    from services.registry import get_job

    learner = next(e for e in get_job(job["kind"]).expand(s, "bench") if e["name"] == "learner")
    evaluation = EvalSettings.model_validate(learner["settings"]["eval"])
    reference_job = {
        "dataset": s.dataset, "rewards": [r.model_dump() for r in s.rewards],
        "eval_dataset": evaluation.dataset, "eval_split": evaluation.split,
        "eval_reward": evaluation.reward, "group_size": s.group_size,
        "groups_per_update": s.groups_per_update, "max_tokens": s.max_tokens,
        "temperature": s.temperature, "learning_rate": s.learning_rate, "epochs": s.epochs,
        "seed": s.seed, "eval_count": s.eval_count,
        "max_updates": int(budget_s / 0.2) + 10,  # a bound: the budget stops it first
    }  # fmt: skip
    return run_reference(
        "bench.lm.grpo_trl_reference", BENCH_DIR / "trl", reference_job, model, budget_s,
        eval_every, TRL_DIAGNOSTICS,
    )  # fmt: skip


def run_reference(
    module: str,
    out: Path,
    reference_job: dict[str, Any],
    model: Path,
    budget_s: float,
    eval_every: int,
    diagnostics: dict[str, str],
    env_extra: dict[str, str] | None = None,
) -> dict:
    """``python -m <module>`` (a TRL reference side) in the TRL venv on ``reference_job``, from
    ``model``, into ``out`` for ``budget_s`` from its start; its evaluations and per-update
    ``diagnostics`` (our name -> the trainer's log key)."""
    python = ensure_venv(TRL_VENV, TRL_REQUIREMENTS, layered_over=ROOT / ".venv")
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    (out / "job.json").write_text(json.dumps(reference_job, indent=2))
    env = {**CHILD_ENV, "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false",
           "OMP_NUM_THREADS": str(os.cpu_count() or 1), **(env_extra or {})}  # fmt: skip
    started = time.time()
    cmd = [str(python), "-m", module, "--job", str(out / "job.json"),
           "--model", str(model), "--out", str(out), "--budget-s", str(budget_s),
           "--started", str(started), "--eval-every", str(eval_every)]  # fmt: skip
    with (out / "console.log").open("w") as console:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=console, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip
        # It stops itself after the update that crosses the budget; a minute of grace.
        _wait_until(proc, started + budget_s + 60)
        stop_process(proc, signal.SIGTERM, group=True, wait_s=120)
    evals = [json.loads(x) for x in (out / "eval.jsonl").read_text().splitlines()]
    updates = [
        {"time_s": r["time_s"], "update": r["update"],
         **{name: _number(r.get(key)) for name, key in diagnostics.items()}}
        for r in map(json.loads, (out / "log.jsonl").read_text().splitlines())
        if "loss" in r
    ]  # fmt: skip
    return {"evals": evals, "updates": updates, "exit_code": proc.returncode}


def _number(value: Any) -> float | None:
    """A trainer log value (TRL logs some as formatted strings) as a float."""
    return None if value is None else float(value)


def _wait_until(proc: subprocess.Popen, deadline: float) -> None:
    while proc.poll() is None and time.time() < deadline:
        time.sleep(1.0)


# --------------------------------------------------------------------------- the comparison


def accuracy_at(evals: list[dict], time_s: float) -> float | None:
    """The accuracy of the last evaluation finished by ``time_s``."""
    done = [e for e in evals if e["time_s"] <= time_s]
    return done[-1]["accuracy"] if done else None


def summarize(side: dict, checkpoints: list[float], budget_s: float) -> dict[str, Any]:
    evals, updates = side["evals"], side["updates"]
    within = [u for u in updates if u["time_s"] <= budget_s]
    tail = [e["accuracy"] for e in evals if budget_s - 120 <= e["time_s"] <= budget_s]
    return {
        "accuracy_at": [accuracy_at(evals, t) for t in checkpoints],
        "mean_accuracy_last_2_min": sum(tail) / len(tail) if tail else None,
        "best_accuracy": max((e["accuracy"] for e in evals), default=None),
        "updates": within[-1]["update"] if within else 0,
        "launch_to_first_update_s": updates[0]["time_s"] if updates else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser, ROOT / "examples" / "grpo_arith.yaml", "algo.old_logp=recompute")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    job, settings = load_job(args.config)
    compare(
        args,
        job,
        post_sft_model(settings),
        rlfleet=lambda model, budget_s: run_rlfleet(job, model, budget_s, args.eval_every),
        trl=lambda model, budget_s: run_trl(settings, job, model, budget_s, args.eval_every),
    )


def add_arguments(parser: argparse.ArgumentParser, config: Path, ablation: str) -> None:
    """The comparison's command line (``ablation``: an example override for the help)."""
    parser.add_argument("--config", type=Path, default=config)
    parser.add_argument("--minutes", type=float, default=15.0, help="wall budget of each side")
    parser.add_argument("--eval-every", type=int, default=10, help="updates between evaluations")
    parser.add_argument("--only", choices=SIDES, nargs="+", default=list(SIDES))
    parser.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE", dest="overrides",
                        help="job keys for the rlfleet side, YAML values, dotted for nested "
                        f"ones: engine=hf, {ablation} (an ablation)")  # fmt: skip
    parser.add_argument("--out", type=Path, default=RESULTS)


Side = Callable[[Path, float], dict]  # (the post-SFT model, budget_s) -> evals and updates


def compare(
    args: argparse.Namespace, job: dict[str, Any], model: Path, *, rlfleet: Side, trl: Side
) -> None:
    """Both sides from one post-SFT ``model``, each for ``--minutes`` from its process start;
    the accuracy ratio at a third, two thirds and all of the budget; the table and the JSON."""
    overrides = parse_overrides(args.overrides)
    apply_overrides(job, overrides)
    budget_s = args.minutes * 60
    checkpoints = [budget_s / 3, 2 * budget_s / 3, budget_s]
    payload: dict[str, Any] = {"machine": machine({"config": str(args.config)})}
    payload["rlfleet_overrides"] = overrides
    sides: dict[str, dict] = {}
    for name in args.only:
        print(f"{name}: {args.minutes:g} minutes from process start ...", flush=True)
        sides[name] = (rlfleet if name == "rlfleet" else trl)(model, budget_s)
        sides[name]["summary"] = summarize(sides[name], checkpoints, budget_s)
    payload.update(model=str(model), budget_s=budget_s, checkpoints_s=checkpoints, sides=sides)
    if len(sides) == 2:
        ours, theirs = (sides[n]["summary"]["accuracy_at"] for n in SIDES)
        ratios = [a / b if a is not None and b else None for a, b in zip(ours, theirs, strict=True)]
        payload["accuracy_ratio_at_5_10_15_min"] = ratios
        payload["target_met"] = all(r is not None and r >= 1.0 for r in ratios)
    print_table(payload)
    write_results(args.out, payload)


def print_table(payload: dict[str, Any]) -> None:
    minutes = [f"{t / 60:g} min" for t in payload["checkpoints_s"]]
    head = ["", *minutes, "last 2 min", "best", "updates", "first update"]
    print(" | ".join(head))
    for name, side in payload["sides"].items():
        s = side["summary"]
        cells = [_f(a) for a in s["accuracy_at"]]
        cells += [_f(s["mean_accuracy_last_2_min"]), _f(s["best_accuracy"]), str(s["updates"]),
                  _f(s["launch_to_first_update_s"], "{:.1f} s")]  # fmt: skip
        print(" | ".join([name, *cells]))
    if "accuracy_ratio_at_5_10_15_min" in payload:
        ratios = payload["accuracy_ratio_at_5_10_15_min"]
        verdict = "met" if payload["target_met"] else "NOT met"
        print(f"rlfleet / TRL: {' '.join(_f(r) for r in ratios)} (target >= 1.0: {verdict})")


def _f(value: float | None, fmt: str = "{:.3f}") -> str:
    return "-" if value is None else fmt.format(value)


if __name__ == "__main__":
    main()
